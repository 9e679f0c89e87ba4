"""rail's records as the controller's seam sees them: the one mapping between the trainer side (a
:class:`policy.records.Trajectory`, a :class:`rail.rounds.Group`, a :class:`rail.interventions.Intervention`)
and :mod:`controller.records` (``Rollout``, ``Group``, ``Intervention``). The learned controller, the
intervention planner and every adapter go through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import controller
from policy.records import Origin, succeeded

if TYPE_CHECKING:
    from rail.rounds import Group, Menu


def rollout(t: Any, logprobs: bool = False) -> controller.Rollout:
    """A scored trajectory as the seam records a rollout: reward, success (:func:`policy.records.succeeded`),
    rubric progress and first violation, tool calls, tokens; with ``logprobs``, the behaviour log-probs of the
    tokens the policy sampled (only the context of a group decided for reads them)."""
    rb = t.rubric
    if rb is not None and not rb.holds:
        rb = None  # a task without a rubric item: no progress recorded, so any failed rollout can be a source
    calls, failed = t.tool_calls()
    lps = [lp for lp, o in zip(t.logprobs, t.origin) if o == Origin.POLICY] if logprobs else ()
    return controller.Rollout(t.reward, succeeded(t.reward), None if rb is None else rb.progress,
                              None if rb is None else rb.first_violated, None if rb is None else rb.violated_turn,
                              calls, failed, lps, t.n_generated)


def group(g: "Group", menu: "Menu | None") -> controller.Group:
    """A step's group as the seam's record ``g<index>``: its base rollouts and, with ``menu``, every legal
    intervention of the menu, priced, its trainer-side intervention as ``ref``. Without a menu (fresh groups the
    rounds' leftover bought: they count in the opportunity and pass rates only), no interventions and no
    log-probs."""
    items = []
    if menu is not None and g.n_base:
        for iv in menu.legal(g):
            items.append(controller.Intervention(iv.name, iv.key, iv.how_many, menu.cost(g, iv), iv.features(),
                                                 ref=iv))
    return controller.Group(f"g{g.index}", g.family, g.task.level, [rollout(t, menu is not None) for t in g.base],
                            items, capacity=g.capacity)
