"""The fixed rule the learned controller shadows, and the ``ladder`` and ``rti`` controllers run: one rung rule.

Written once, so that "the learned controller beats ladder" compares it against exactly the choices its
off-policy gate evaluated in shadow (docs/controller.md, "The shadowed heuristic").

* **who is asked**: in round 0 every group with base rollouts; in round ``r > 0`` a group whose interventions
  ran in each of the ``r`` rounds before (``len(tried) == r``) and left it without a success;
* **which rung**: nothing for a group with a success; otherwise the first rung of the ladder not yet tried on the
  group among the rungs it can act on (:func:`actionable`: legal there, at the rule's size, within the group's
  room); without escalation (RTI: one hint) a rung only for a group nothing was tried on;
* **under a budget** (:func:`rung_plan`): the groups asked are served in the order given (the order the trainer
  added them), each taking its rung when its cost fits what the groups before it left, else nothing.
"""

from __future__ import annotations

from typing import Collection, Iterable, Mapping, Sequence, TypeVar

T = TypeVar("T")
#: costs are compared with this slack (a cost summed from float shares may land a hair above the room it fills)
EPS = 1e-9


def fits(cost: float, room: float | None) -> bool:
    """Whether a cost fits in ``room`` (None: no cap). The one comparison behind a group's capacity, the rule's
    budget and the bandit's."""
    return room is None or cost <= room + EPS


def asked(round: int, tried: Sequence[str], solved: bool) -> bool:
    """Whether a group is decided for in round ``round``, given the keys of the interventions that ran on it
    this step (``tried``, in order) and whether it has a success."""
    return len(tried) == round and not (round and solved)


def actionable(priced: Iterable[tuple[str, float | None, T]], room: float | None) -> dict[str, tuple[T, float]]:
    """The rungs the rule can act on in a group: of its ``(key, cost, item)`` at the rule's size (cost None: not
    legal there), those legal and within ``room``, the group's capacity less what ran on it (None: no cap)."""
    return {k: (item, c) for k, c, item in priced if c is not None and fits(c, room)}


def next_rung(ladder: Sequence[str], tried: Sequence[str], actionable: Collection[str], solved: bool,
              escalates: bool = True) -> str | None:
    """The rung (a ``how@where`` key of ``ladder``) the rule takes on a group, or None for nothing.

    ``actionable``: the keys it can act on there (:func:`actionable`)."""
    if solved:
        return None
    rungs = [k for k in ladder if k not in tried] if escalates else ([] if tried else list(ladder))
    return next((k for k in rungs if k in actionable), None)


def rung_plan(groups: Iterable[tuple[str, Sequence[str], Sequence[str], bool, Mapping[str, tuple[T, float]]]],
              budget: float, escalates: bool = True) -> dict[str, tuple[str, T, float]]:
    """The rule's decisions for one round: for each asked group ``(id, ladder, tried, solved, actionable)``, in
    order, its next rung on its ladder (:func:`next_rung`) when that rung's cost fits what the groups before it
    left of ``budget``. Returns ``{id: (key, item, cost)}`` for the groups it intervenes on."""
    left, out = float(budget), {}
    for gid, ladder, tried, solved, acts in groups:
        key = next_rung(ladder, tried, acts, solved, escalates)
        if key is None:
            continue
        item, cost = acts[key]
        if fits(cost, left):
            out[gid] = (key, item, cost)
            left -= cost
    return out
