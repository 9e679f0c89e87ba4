"""The controller's reward: the learning signal an intervention added to its group, per unit of cost.

Defined here once:

* ``signal(rewards) = 4 p (1 - p)`` with ``p`` the group's mean reward over the rollouts the learner trains
  on (binary rewards; for graded ones ``4 * variance``, capped at 1). It is 0 for a group whose rollouts all
  agree (GRPO learns nothing from it) and 1 when half succeed.
* ``improvement = max(0, signal(after) - signal(before))``: ``before`` is the base rollouts, ``after`` the base
  rollouts plus the intervention's rollouts that the learner accepted (``mix``), or the accepted rollouts
  alone (``replace``). Rollouts the shift filter rejected add nothing.
* ``reward = min(1, headroom * improvement * unit / cost)``: ``unit`` is the cost of the
  cheapest intervention, so an intervention that gives a dead group full signal at the lowest price scores 1,
  one that needs twice the budget for the same gain scores half.
* ``headroom`` (1 unless the caller weights by it; ``controller.Session`` always does) is
  ``1 - q``, ``q`` the policy's recent unguided pass rate on the group's kind of task (rail: its family and
  level). A unit of learning signal moves success on a kind of task in proportion to what is left to learn
  there: signal on a cell the policy already solves 90 % of the time buys little, signal on a cell it cannot
  solve buys the skill the run is missing.
* With ``absorbed`` (``SessionSettings.reward = "learning"``): the reward above times
  ``min(1, max(0, absorbed) / scale)``: ``absorbed`` is what the unguided policy takes from the intervention's
  trained rollouts (the trainer measures it; rail: the first-order change of the likelihood of reference
  solutions of the group's kind of task that the update makes from them, ``rail.learning``), ``scale`` the typical
  positive absorption so far. The signal an intervention added counts only as far as the policy learns from it:
  a rescue whose help gives the answer away, or whose tokens the learner barely moves, earns little.
* Doing nothing costs nothing and earns ``opportunity``: the signal per ``unit`` of budget that fresh base
  groups earned this step, each weighted by its own headroom when headrooms are given — what the saved budget
  buys instead. An intervention pays only when it beats it.
"""

from __future__ import annotations

import math
from typing import Sequence


def signal(rewards: Sequence[float]) -> float:
    """Learning signal of a group: 4 x the variance of its rewards, in [0, 1]."""
    n = len(rewards)
    if n < 2:
        return 0.0
    m = sum(rewards) / n
    var = sum((r - m) ** 2 for r in rewards) / n
    return min(1.0, 4.0 * var)


def improvement(before: Sequence[float], accepted: Sequence[float], compose: str = "mix") -> float:
    after = list(accepted) if compose == "replace" else [*before, *accepted]
    return max(0.0, signal(after) - signal(before))


def _check_headroom(h: float) -> float:
    if not (math.isfinite(h) and 0.0 <= h <= 1.0):
        raise ValueError(f"a headroom must be in [0, 1] (1 - a pass rate), got {h}")
    return h


def reward(before: Sequence[float], accepted: Sequence[float], cost: float, unit: float,
           compose: str = "mix", headroom: float = 1.0) -> float:
    """Improvement times ``headroom``, per unit of cost, bounded in [0, 1]."""
    if cost <= 0:
        raise ValueError(f"an intervention's cost must be > 0, got {cost}")
    return min(1.0, _check_headroom(headroom) * improvement(before, accepted, compose) * unit / cost)


def learning_reward(before: Sequence[float], accepted: Sequence[float], cost: float, unit: float, absorbed: float,
                    scale: float, compose: str = "mix", headroom: float = 1.0) -> float:
    """:func:`reward` counted as far as the policy learns from the intervention: times
    ``min(1, max(0, absorbed) / scale)`` (``scale`` > 0, the typical positive absorption), in [0, 1]."""
    if not math.isfinite(absorbed):
        raise ValueError(f"an absorption must be a finite number, got {absorbed}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"the absorption scale must be > 0, got {scale}")
    return reward(before, accepted, cost, unit, compose, headroom) * min(1.0, max(0.0, absorbed) / scale)


def opportunity(group_rewards: Sequence[Sequence[float]], group_cost: float, unit: float,
                headrooms: Sequence[float] | None = None) -> float:
    """What doing nothing earns: the mean signal of fresh base groups (each times its headroom, when given), per
    ``unit`` of budget, in [0, 1]."""
    if not group_rewards or group_cost <= 0:
        return 0.0
    if headrooms is None:
        headrooms = [1.0] * len(group_rewards)
    if len(headrooms) != len(group_rewards):
        raise ValueError(f"{len(headrooms)} headrooms for {len(group_rewards)} groups")
    mean = sum(_check_headroom(h) * signal(g) for g, h in zip(group_rewards, headrooms)) / len(group_rewards)
    return min(1.0, mean * unit / group_cost)
