"""The records a trainer and the controller exchange, one type per concept (docs/glossary.md):

* :class:`Rollout`: one scored rollout, as the trainer saw it;
* :class:`Intervention`: one legal intervention on a group, priced before anything runs (the bandit's action;
  doing nothing is not an intervention, it is ``None``);
* :class:`Group`: one task's scored base rollouts in a step, with its menu of interventions;
* :class:`Decision`: what the controller decided for one group in one round: an intervention or nothing, with the
  probability it was chosen with.

Torch-free, like the whole package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class Rollout:
    """One scored rollout, as the trainer saw it."""

    reward: float
    success: bool
    progress: float | None = None  # rubric progress in [0, 1]; None: the task has no rubric
    violated_item: int | None = None  # the first rubric item it violated (None: none)
    violated_turn: int | None = None  # the turn at which it did
    tool_calls: int = 0  # tool calls it made
    tool_failures: int = 0  # ... of which failed
    logprobs: Sequence[float] = ()  # behaviour log-probs of the tokens the policy sampled (not tool or injected ones)
    tokens: int = 0  # tokens it generated (a copied prefix not counted)
    accepted: bool = True  # the learner trains on it (False: a filter, e.g. a shift filter, dropped it)


@dataclass
class Intervention:
    """A legal intervention on a group, priced before anything runs."""

    name: str  # unique within the group; names the action in traces
    key: str  # operator and branch point, "how@where": what the heuristic's ladder and ``tried`` speak of
    size: int  # rollouts it runs
    cost: float  # in the budget's unit (rollouts or tokens)
    features: dict = field(default_factory=dict)  # action features for the bandit (strings categorical)
    ref: Any = None  # the trainer's own object for it, handed back in the Decision; never logged


@dataclass
class Group:
    """One task's group of base rollouts, scored, with its menu: the interventions legal on it."""

    id: str  # unique within the step; part of every event id
    family: str  # kind of task
    level: int | str  # difficulty; family/level is the cell of the pass-rate EMA
    rollouts: Sequence[Rollout]  # the base (on-policy, unguided) rollouts
    menu: Sequence[Intervention] = ()
    capacity: float | None = None  # the most its interventions may cost this step (TRL: free slots); None: no cap

    @property
    def cell(self) -> str:
        """``family/level``: the kind of task its pass rate is kept for."""
        return f"{self.family}/{self.level}"


@dataclass
class Decision:
    """The controller's decision for one group in one round: ``intervention`` None means do nothing."""

    id: str  # event id: report the outcome under it
    group: str
    intervention: Intervention | None
    propensity: float  # the probability with which it was chosen
    mode: str  # "shadow" (the randomised heuristic acted) or "live" (the bandit acted)
    round: int = 0  # the step's round it was made in (set by the Session)
    heuristic: Intervention | None = None  # what the shadowed heuristic decides there, acting or not (Session)

    @property
    def intervenes(self) -> bool:
        return self.intervention is not None
