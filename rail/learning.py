"""The learned controller's "learning" reward, rail's side (``controller.reward = "learning"``): what the unguided
policy absorbs from each intervention.

For each cell (family and level) a fixed sample of ``controller.reference_tasks`` training tasks is solved by its
action guide (:func:`rail.policy_setup.reference_trajectory`, unguided). An intervention's *absorption* is the
first-order change of the mean log-likelihood of its cell's reference solutions that the step's update makes from
its trained rollouts (:func:`policy.influence.update_influence`), measured after the learner's filters and before
the update. The session turns it into the decision's reward (``controller.reward.learning_reward``). A cell whose
tasks have no action guide has no reference: its interventions are rewarded by their signal.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from policy.influence import update_influence
from policy.records import Status
from rail.policy_setup import reference_trajectory


class Absorption:
    """Reference solutions per cell (drawn once per run, from the run seed), and each outcome's absorption."""

    def __init__(self, cfg, envs: dict, renderer):
        self.cfg, self.envs, self.renderer = cfg, envs, renderer
        self._refs: dict[tuple[str, int], list | None] = {}

    def references(self, family: str, level: int) -> list | None:
        key = (family, level)
        if key not in self._refs:
            env = self.envs[family]
            rng = np.random.default_rng([self.cfg.run.seed, 40_000, level, zlib.crc32(family.encode())])
            tasks = env.sample_tasks(rng, [level], self.cfg.controller.reference_tasks)
            refs = [reference_trajectory(env, t, self.renderer, tool_format=self.cfg.rollout.tool_format)
                    for t in tasks if t.action_guide]
            self._refs[key] = refs or None
        return self._refs[key]

    def __call__(self, learner, batch, groups: Sequence, outcomes: Sequence) -> list[float | None]:
        """One absorption per outcome: 0 for one with no trained rollout; None for a refill, a decision that did
        not run, or a cell without references (those are rewarded by their signal). ``batch`` is the learner's
        prepared batch (trained rollouts, their advantages, and guided replays of them)."""
        adv = {id(t): a for t, a in zip(batch.trajectories, batch.advantages) if t.status == Status.TRAINED}
        replays: dict[int, list] = {}
        for t, a in zip(batch.trajectories, batch.advantages):
            if t.status == Status.GUIDED_REPLAY:  # a copy of a trained rollout, its token lists shared
                replays.setdefault(id(t.ids), []).append((t, a))
        total = sum(sum(t.training_view()[1]) for t in batch.trajectories)
        out: list[float | None] = [None] * len(outcomes)
        by_cell: dict[tuple[str, int], list[int]] = {}
        for k, o in enumerate(outcomes):
            if o.ran and not o.decision.refill:
                g = groups[o.decision.group]
                by_cell.setdefault((g.family, int(g.task.level)), []).append(k)
        for (family, level), ks in by_cell.items():
            refs = self.references(family, level)
            if refs is None:
                continue
            sets = [[(t, adv[id(t)]) for t in outcomes[k].trajectories if id(t) in adv]
                    + [r for t in outcomes[k].trajectories if id(t) in adv for r in replays.get(id(t.ids), [])]
                    for k in ks]
            for k, a in zip(ks, update_influence(learner, refs, sets, total)):
                out[k] = 0.0 if a is None else a  # no trained rollout: nothing absorbed
        return out
