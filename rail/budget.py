"""The rollout budget: what a step may spend on generation, and a ledger of what was spent on what.

Base rollouts and interventions draw from the same per-step budget, counted in ``rollouts`` or in generated
``tokens``. The ledger refuses any charge that would overspend, so "never exceeds the budget" is enforced in
one place rather than trusted to each caller.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

KINDS = ("base", "intervention")


class BudgetExceeded(RuntimeError):
    pass


def cost_of(trajectories, unit: str) -> int:
    """What generating ``trajectories`` cost in ``unit``: one per rollout, or the tokens it sampled."""
    if unit == "rollouts":
        return len(trajectories)
    return sum(t.n_generated for t in trajectories)


@dataclass
class StepBudget:
    """One step's budget; ``charge`` is the only way to spend it."""

    unit: str
    limit: int
    spent: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})

    @property
    def used(self) -> int:
        return sum(self.spent.values())

    @property
    def remaining(self) -> int:
        return self.limit - self.used

    def charge(self, kind: str, amount: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown spend kind {kind!r}; one of {KINDS}")
        if amount < 0 or amount > self.remaining:
            raise BudgetExceeded(f"charging {amount} {self.unit} for {kind} with {self.remaining} left")
        self.spent[kind] += amount


@dataclass
class BudgetLedger:
    """Totals over the run (checkpointed), and the per-step budgets it hands out."""

    unit: str
    per_step: int
    total: int = 0  # 0: unlimited
    spent: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})

    @property
    def used(self) -> int:
        return sum(self.spent.values())

    def exhausted(self, min_cost: int) -> bool:
        return bool(self.total) and self.total - self.used < min_cost

    def open_step(self) -> StepBudget:
        limit = self.per_step if not self.total else min(self.per_step, self.total - self.used)
        return StepBudget(self.unit, limit)

    def close_step(self, step: StepBudget) -> dict[str, float]:
        for k in KINDS:
            self.spent[k] += step.spent[k]
        return {
            "budget/step_limit": float(step.limit),
            "budget/step_base": float(step.spent["base"]),
            "budget/step_intervention": float(step.spent["intervention"]),
            "budget/step_left": float(step.remaining),
            "budget/spent_total": float(self.used),
            "budget/spent_base": float(self.spent["base"]),
            "budget/spent_intervention": float(self.spent["intervention"]),
        }

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        self.spent = {k: int(d["spent"][k]) for k in KINDS}
