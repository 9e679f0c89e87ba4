"""The learned intervention controller: a torch-free contextual-bandit library (see docs/controller.md).

    from controller import LearnedController, Settings, Group, Action
    ctl = LearnedController(Settings(), seed=0, trace_dir="runs/x/traces")
    decisions = ctl.decide([Group("g0", {"level": "3", "successes": 0}, [Action("hint", {"how": "hint"}, 4)],
                                  heuristic="hint")], budget=16)
    ctl.feedback(decisions[0].id, reward=0.5)

The reward is ``controller.reward``; traces are ``controller.traces``. It imports nothing from ``rail`` or
``policy`` and no torch.
"""

from controller.core import NONE, Action, Decision, Group, LearnedController, Settings

__all__ = ["NONE", "Action", "Decision", "Group", "LearnedController", "Settings"]
