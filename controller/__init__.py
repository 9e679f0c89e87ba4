"""The learned intervention controller: a torch-free contextual-bandit library (see docs/controller.md).

A trainer speaks to it through one :class:`Session` per run (``controller.session``) in the records of
``controller.records``: scored groups with their menus of legal, priced interventions in; decisions (group,
intervention or nothing, propensity, event id) out; the chosen interventions' rollouts in; the reward, learning,
traces, shadow-to-live and state handled inside::

    from controller import Group, Intervention, Rollout, Session, SessionSettings
    s = Session(SessionSettings(), seed=0, trace_dir="runs/x/traces")
    s.begin_step(step=0, total_steps=100, step_budget=64)
    s.add([Group("p0", "calc", 3, [Rollout(0.0, False), Rollout(0.0, False)],
                 [Intervention("hint x2", "rubric_hint@violation", 2, cost=2)])])
    for d in s.decide(budget=16):
        if d.intervenes:
            s.ran(d.id, [Rollout(1.0, True), Rollout(0.0, False)], cost=2)
    s.end_step()

Underneath, :class:`LearnedController` is the bandit with its gate (decide for :class:`Context` objects,
feedback a reward); the reward is ``controller.reward``, traces ``controller.traces``. It imports nothing from
``rail`` or ``policy`` and no torch.
"""

from controller.core import NONE, Context, LearnedController, Settings
from controller.records import Decision, Group, Intervention, Rollout
from controller.session import Session, SessionSettings, branch_source

__all__ = ["NONE", "Context", "Decision", "Group", "Intervention", "LearnedController", "Rollout", "Session",
           "SessionSettings", "Settings", "branch_source"]
