"""Fixed group slots: rail's interventions in a trainer whose groups have a fixed size (TRL's ``num_generations``,
verl's ``rollout.n``). The TRL and verl adapters share it; each brings only a way to generate rollouts.

A step over groups of ``g`` slots (docs/integrations.md, "Slots"):

1. ``controller.base_share`` of each group's slots (all of them for ``controller.name = "none"``) get base
   rollouts; the rest are the group's ``capacity`` (``GroupView.capacity``, which the learned controller's
   ``controller.Session`` respects), and the step's budget is the sum of the free slots;
2. the controller's rounds, the ``decide`` / ``observe`` / ``feedback`` protocol of ``rail.controllers`` that rail's
   own training loop drives, each decision planned by :func:`rail.interventions.plan` through
   :func:`rail.rounds.make_menu` (a decision runs when its rollouts fit the step's and its group's free
   slots);
3. whatever the rounds left is filled with more base rollouts of the same task;
4. after the trainer's filters (``shift_rejected``), each rollout's ``status`` as rail's learner sets it, the
   controller's feedback (its rewards, trace lines and state) and the ``intervention/*`` metrics of
   :func:`rail.rounds.intervention_metrics`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine, Sequence

import numpy as np

from policy.engine import RolloutRequest
from policy.learner import assign_status
from policy.records import Status, succeeded
from rail.budget import StepBudget
from rail.config import Config, ConfigError, validate
from rail.controllers import CONTROLLERS, compose_of
from rail.envs import ToolRunner, make_envs
from rail.rounds import (Group, Outcome, Rounds, adrive, intervention_metrics, intervention_summary, make_group,
                         make_menu, unguided_requests)

#: controllers whose decisions need groups of their own (dapo's refills) or untrained probes (actguide's search)
UNSUPPORTED = {"dapo": "its refills are fresh groups", "actguide": "its plan-length probes are not trained"}

#: ``generate(requests, key)`` -> one scored trajectory per request, in order; ``key`` names the call within the
#: step (("base",), ("round", r), ("fill",)) for the trainer's seeds
Generate = Callable[[list[RolloutRequest], tuple], Awaitable[list]]


def run_sync(coro: Coroutine) -> Any:
    """Run ``coro`` to its end from synchronous code (TRL's ``rollout_func``), also when the caller already runs an
    event loop (a notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def check(cfg: Config, trainer: str) -> None:
    """What a trainer with fixed group slots cannot run, as a config error naming the field."""
    if cfg.controller.name in UNSUPPORTED:
        raise ConfigError(f"controller.name = {cfg.controller.name!r} cannot run inside {trainer} "
                          f"({UNSUPPORTED[cfg.controller.name]}, but {trainer}'s groups are fixed slots of one "
                          f"prompt); use one of {', '.join(k for k in CONTROLLERS if k not in UNSUPPORTED)}")
    if cfg.budget.unit != "rollouts":
        raise ConfigError(f"budget.unit = {cfg.budget.unit!r}: inside {trainer} the budget is the groups' slots; "
                          "set budget.unit = 'rollouts'")
    validate(cfg)


class Slots:
    """rail's controller over fixed group slots for one training run (``cfg`` is the run's own copy; ``group_size``
    is the trainer's slots per group, ``out`` where the controller writes its trace; ``envs`` the environments of
    ``env.families`` when the adapter already made them)."""

    def __init__(self, cfg: Config, group_size: int, out: str | Path | None, trainer: str = "the trainer",
                 envs: dict | None = None):
        cfg.budget.group_size = int(group_size)
        cfg.budget.rollouts_per_step = max(cfg.budget.rollouts_per_step, cfg.budget.group_size)
        check(cfg, trainer)
        self.cfg, self.g = cfg, int(group_size)
        self.envs = envs or make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)
        self.runners = {f: ToolRunner(e, cfg.rollout.tool_format) for f, e in self.envs.items()}
        self.controller = CONTROLLERS[cfg.controller.name](config=cfg, out=out)
        self.compose = compose_of(cfg)
        self.calls = 0  # training steps so far (the trainers' seeds derive from it)
        self.spent = {"base": 0.0, "intervention": 0.0}
        self.per_key: dict = {}  # how@where -> totals (rail.rounds.intervention_metrics)
        self.totals: dict = {}

    @property
    def n_base(self) -> int:
        share = 1.0 if self.cfg.controller.name == "none" else self.cfg.controller.base_share
        return min(self.g, max(1, round(self.g * share)))

    def requests(self, tasks: Sequence[tuple[str, object]], groups: Sequence[int], k: int) -> list:
        """``k`` unguided rollouts of each group index in ``groups``."""
        return unguided_requests(tasks, groups, k, self.envs, self.runners)

    async def step(self, tasks: Sequence[tuple[str, object]], step: int, total_steps: int, seed: int,
                   generate: Generate) -> tuple[list[Group], list[Outcome], list[list]]:
        """One step over ``tasks`` ((family, task) per group): base slots, then the step protocol of
        :mod:`rail.rounds` (the controller's rounds on the groups' free slots, the fill of what is left). Returns
        the groups, the outcomes of the decisions that ran and each group's ``g`` trajectories (base,
        interventions in order, fill)."""
        self.calls += 1
        cfg, g = self.cfg, self.g
        tasks = list(tasks)
        budget = StepBudget("rollouts", len(tasks) * g)  # every slot of the step, as rail's own loop counts a step
        base = await generate(self.requests(tasks, range(len(tasks)), self.n_base), ("base",))
        budget.charge("base", len(base))  # what is left is the groups' free slots
        groups = [make_group(i, fam, task, base, capacity=g - self.n_base) for i, (fam, task) in enumerate(tasks)]
        self.controller.begin_step(step, max(1, total_steps), budget, np.random.default_rng([seed, self.calls, 4]))
        rounds = Rounds(self.controller, groups, tasks, make_menu(cfg, self.envs, self.runners), budget,
                        max_rounds=cfg.controller.max_rounds, group_size=g,
                        base_requests=lambda idx, k: self.requests(tasks, idx, k))
        ran = await adrive(rounds.protocol(), lambda gen: generate(gen.requests, gen.key))
        return groups, ran, [x.trajectories for x in groups]

    def finish(self, groups: list[Group], ran: list[Outcome], slots: list[list],
               shift_of: Callable[[list], list[float]] | None = None) -> dict[str, float]:
        """The learner's filters (:func:`policy.learner.assign_status`: rail's rule for every rollout's status, the
        shift filter measured by ``shift_of`` under the trainer's current weights when it has them), the
        controller's feedback, and the step's metrics."""
        L = self.cfg.learner
        assign_status([t for s in slots for t in s], self.compose, shift_of=shift_of,
                      shift_threshold=L.shift_threshold, drop_zero_variance=L.drop_zero_variance,
                      mask_all_tools_failed=L.mask_all_tools_failed)
        self.controller.feedback(groups, ran, self.compose)
        n = sum(len(s) for s in slots)
        n_iv = sum(len(o.trajectories) for o in ran)
        self.spent["base"] += n - n_iv
        self.spent["intervention"] += n_iv
        m = intervention_metrics(groups, ran, n_iv / n if n else 0.0, self.per_key, self.totals)
        base = [t.reward for x in groups for t in x.base]
        out = {"rollout/success_rate": float(np.mean([succeeded(r) for r in base])) if base else 0.0,
               "shift/rejected": float(sum(t.status == Status.SHIFT_REJECTED for s in slots for t in s)),
               **{k: m[k] for k in ("intervention/decisions", "intervention/rollouts", "intervention/success_rate",
                                    "intervention/budget_share", "intervention/rescued_groups")}}
        if self.cfg.controller.name == "rail":
            cm = self.controller.metrics()
            out.update({k: cm[k] for k in ("controller/live", "controller/events")})
        return out

    # ------------------------------------------------------------------ state and report
    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict(), "calls": self.calls, "spent": self.spent,
                "per_key": self.per_key, "totals": self.totals}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; the learned controller cuts its trace back to the events it had learned."""
        self.controller.load_state_dict(state.get("controller", {}))
        self.calls = int(state.get("calls", 0))
        self.spent = dict(state.get("spent", self.spent))
        self.per_key, self.totals = dict(state.get("per_key", {})), dict(state.get("totals", {}))

    def summary(self) -> dict:
        """The run's interventions (``rail train``'s summary.json ``interventions`` section) and the controller's
        state (mode, events, transitions, trace)."""
        return {"controller": self.cfg.controller.name, "steps": self.calls,
                "rollouts": {k: int(v) for k, v in self.spent.items()},
                "interventions": intervention_summary(self.per_key, self.totals, self.spent["base"],
                                                      self.spent["intervention"]),
                "controller_state": self.controller.summary()}

    def report(self, trainer: str) -> str:
        """The summary as ``rail train`` prints it: rollouts, the interventions table, the controller's line."""
        from rail.report import format_interventions

        s = self.summary()
        r = s["rollouts"]
        head = (f"rail in {trainer}: controller={s['controller']}  steps={s['steps']}  rollouts "
                f"{r['base'] + r['intervention']} ({r['base']} base, {r['intervention']} intervention)")
        return "\n".join([head, format_interventions(s["interventions"], s["controller_state"])]).rstrip()
