"""Intervention controllers, chosen by name (``--controller``).

After a step's base rollouts are scored, the training loop hands the controller every group and the step's
remaining budget; the controller returns intervention decisions to run (each charged to the budget before it
runs) and later receives their outcomes. ``none`` is plain GRPO: it never intervenes, so the whole budget
goes to base groups. The intervention operators and the learned controller plug in here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


@dataclass
class GroupView:
    """What a controller sees of one scored base group."""

    group: int
    task: Any
    trajectories: list  # policy.records.Trajectory
    rewards: list[float] = field(default_factory=list)


@dataclass
class InterventionDecision:
    group: int
    operator: str
    params: dict
    cost: int


class Controller(Protocol):
    name: str

    def plan_base(self, step_budget: int, group_size: int, unit: str) -> int:
        """How many base groups to generate this step."""

    def decide(self, groups: Sequence[GroupView], remaining: int, unit: str) -> list[InterventionDecision]:
        """Interventions to run after the base rollouts, within ``remaining``."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class NoController:
    """Plain GRPO: every rollout of the budget goes to base groups; never intervenes."""

    name = "none"

    def __init__(self, **_: Any):
        pass

    def plan_base(self, step_budget: int, group_size: int, unit: str, tokens_per_rollout: float = 1.0) -> int:
        per_rollout = 1.0 if unit == "rollouts" else max(1.0, tokens_per_rollout)
        return max(1, int(step_budget // (group_size * per_rollout)))

    def decide(self, groups, remaining, unit) -> list[InterventionDecision]:
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


CONTROLLERS: dict[str, type] = {"none": NoController}
