"""The fixed rule the learned controller shadows, and the ``ladder`` and ``rti`` controllers run: one rung rule.

Written once, so that "the learned controller beats ladder" compares it against exactly the choices its
off-policy gate evaluated in shadow (docs/controller.md, "The shadowed heuristic").

* **who is asked**: in round 0 every group with base rollouts; in round ``r > 0`` a group whose interventions
  ran in each of the ``r`` rounds before (``len(tried) == r``) and left it without a success;
* **which rung**: nothing for a group with a success; otherwise the first rung of the ladder not yet tried on the
  group among the rungs it can act on (legal there, at the rule's size, within its capacity); without escalation
  (RTI: one hint) a rung only for a group nothing was tried on.
"""

from __future__ import annotations

from typing import Collection, Sequence


def asked(round: int, tried: Sequence[str], solved: bool) -> bool:
    """Whether a group is decided for in round ``round``, given the keys of the interventions that ran on it
    this step (``tried``, in order) and whether it has a success."""
    return len(tried) == round and not (round and solved)


def next_rung(ladder: Sequence[str], tried: Sequence[str], actionable: Collection[str], solved: bool,
              escalates: bool = True) -> str | None:
    """The rung (a ``how@where`` key of ``ladder``) the rule takes on a group, or None for nothing.

    ``actionable``: the keys it can act on there (legal, at the rule's size, affordable)."""
    if solved:
        return None
    rungs = [k for k in ladder if k not in tried] if escalates else ([] if tried else list(ladder))
    return next((k for k in rungs if k in actionable), None)
