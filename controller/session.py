"""The controller seam: what a trainer hands the learned controller in a training step and what it gets back.

Any GRPO-style trainer (rail's own, TRL's ``GRPOTrainer`` through a ``rollout_func``, a verl agent loop, a
home-grown loop) drives one :class:`Session` with the records of :mod:`controller.records`; nothing here knows
about models, tokens or torch. One step::

    s.begin_step(step, total_steps, step_budget)
    s.add([Group(...), ...])                 # the step's scored base groups, each with its menu of interventions
    while True:                              # rounds
        decisions = s.decide(budget_left)    # a Decision for every group asked this round
        if not any(d.intervenes for d in decisions):
            break
        for d in decisions:
            if d.intervenes:                 # run d.intervention (its .ref is the trainer's own object for it)
                s.ran(d.id, rollouts, cost)  # its scored rollouts and what it actually cost
    s.end_step()                             # rewards, learning, traces, the gate, pass rates

and between steps ``state_dict()`` / ``load_state_dict()`` (or ``save`` / ``load``) with the trainer's
checkpoints. What the session does for the trainer (``docs/controller.md``, "Using the controller in another
trainer"):

* **the context** of a group, built from its base rollouts (family, level, successes, reward spread, rubric
  progress, the first violated item and its turn of the rollout an intervention would branch from, tool
  failures, mean behaviour log-prob), the recent pass rate of its family/level, training progress, the budget
  left and, in later rounds, what was already tried on it;
* **the menu as bandit actions**: the group's interventions (``how@where`` key, size, cost, features) plus doing
  nothing, with the intervention's share of the step budget as a feature; interventions beyond a group's
  ``capacity`` (TRL: its free slots) are left out;
* **the shadowed heuristic** and **who is asked each round**: the rung rule of :mod:`controller.heuristic`, the
  same functions rail's ``ladder`` and ``rti`` controllers run, budget included (:func:`~controller.heuristic.
  rung_plan`, groups in the order added): round 0 asks every group added before it, each later round the groups
  whose intervention in the round before ran and left them without a success; the heuristic takes the ladder's
  first untried rung among the group's interventions at the ladder's size (or, not escalating, RTI's one hint),
  nothing for a group with a success;
* **the reward** of every decision (``controller.reward``): the signal its accepted rollouts added to what the
  group had before it, weighted by headroom, per unit of cost; doing nothing earns the opportunity of fresh
  base groups;
* **the pass-rate EMA** per family/level (the context's ``pass_rate`` and the headroom), traces, shadow-to-live
  and state, through :class:`~controller.core.LearnedController`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from itertools import chain
from pathlib import Path
from typing import Mapping, Sequence

from controller import reward as R
from controller.core import NONE, Context, LearnedController, Settings, write_atomic
from controller.heuristic import actionable, asked as _asked, fits, rung_plan
from controller.records import Decision, Group, Intervention, Rollout

REWARDS = ("signal", "learning")


@dataclass
class SessionSettings:
    """What a trainer tells the session once (``docs/controller.md``); the bandit and its gate are ``bandit``."""

    bandit: Settings = field(default_factory=Settings)
    ladder: tuple[str, ...] = ("resample@violation", "rubric_hint@violation", "guided_step@violation",
                               "action_guide@start")  # the shadowed heuristic's rungs (keys), cheapest first
    ladder_size: int = 2  # the heuristic's intervention size on every rung
    heuristic_escalates: bool = True  # False: the heuristic acts only on a group nothing was tried on (RTI)
    group_size: int = 8  # rollouts of a fresh base group: what doing nothing buys instead
    unit: float = 2.0  # rollouts of the cheapest intervention: the reward's unit of cost
    budget_unit: str = "rollouts"  # or "tokens": costs are tokens; a rollout counts its mean base tokens
    compose: str = "mix"  # intervened rollouts join their group ("mix") or replace its base rollouts ("replace")
    pass_rate_weight: float = 0.1  # weight of a step's own base pass rate in the family/level's EMA
    reward: str = "signal"  # or "learning": the signal counted as far as the policy learns from it (absorbed)

    def __post_init__(self):
        if isinstance(self.bandit, dict):
            self.bandit = Settings(**self.bandit)
        self.ladder = tuple(self.ladder)
        if self.budget_unit not in ("rollouts", "tokens"):
            raise ValueError(f"budget_unit must be 'rollouts' or 'tokens', got {self.budget_unit!r}")
        if self.compose not in ("mix", "replace"):
            raise ValueError(f"compose must be 'mix' or 'replace', got {self.compose!r}")
        if self.ladder_size < 1 or self.group_size < 1 or not self.unit > 0:
            raise ValueError("ladder_size >= 1, group_size >= 1 and unit > 0 are required")
        if not 0.0 < self.pass_rate_weight <= 1.0:
            raise ValueError(f"pass_rate_weight must be in (0, 1], got {self.pass_rate_weight}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")


def branch_source(rollouts: Sequence[Rollout]) -> int | None:
    """The failed rollout an intervention branches from: most rubric progress, then latest violation, then the
    lowest index; None when no failed rollout violated a rubric item. On a task without a rubric (no progress
    recorded) every failed rollout can be a source: the highest reward, then the lowest index."""
    failed = [i for i, r in enumerate(rollouts) if not r.success and (r.violated_item is not None or r.progress is None)]
    if not failed:
        return None
    return max(failed, key=lambda i: (rollouts[i].reward if rollouts[i].progress is None else rollouts[i].progress or 0.0,
                                      rollouts[i].violated_turn or 0, -i))


def base_pass(g: Group) -> float:
    """The share of a group's base rollouts that succeeded."""
    return sum(1 for r in g.rollouts if r.success) / len(g.rollouts)


class Session:
    """The learned controller for one training run, spoken to in groups, interventions and decisions."""

    def __init__(self, settings: SessionSettings | None = None, seed: int = 0,
                 trace_dir: str | os.PathLike | None = None):
        self.s = settings or SessionSettings()
        self.seed = seed
        self.ctl = LearnedController(self.s.bandit, seed=seed, trace_dir=trace_dir)
        self.pass_rate: dict[str, float] = {}  # EMA of base success per family/level
        self.seconds = 0.0  # time spent in the session's own methods
        self.step, self.total_steps, self.step_budget = 0, 1, 1.0
        self.round = 0
        # the step: its groups (in the order added), and per group the event ids of the interventions that ran
        # on it (in order) and the step-constant part of its context
        self._groups: dict[str, Group] = {}
        self._ran: dict[str, list[str]] = {}
        self._static: dict[str, dict] = {}
        self._made: list[tuple[Decision, list[str]]] = []  # every decision, with the events that ran before it
        self._by_id: dict[str, Decision] = {}
        self._outcomes: dict[str, tuple[list[Rollout], float]] = {}
        self.reused: dict | None = None  # what reuse() started from
        self.absorbed_scale: float | None = None  # the typical positive absorption (reward = "learning")

    # ------------------------------------------------------------------ the step
    def begin_step(self, step: int, total_steps: int, step_budget: float) -> None:
        """Start step ``step`` of ``total_steps`` (training progress is their ratio); ``step_budget`` is what the
        whole step may spend (the intervention's share of it and the share left are features)."""
        if self._made:
            raise RuntimeError("begin_step: the previous step was not ended (call end_step)")
        self.step, self.total_steps, self.step_budget = step, max(1, total_steps), max(1, step_budget)
        self.round = 0
        self._groups, self._ran, self._static, self._outcomes = {}, {}, {}, {}

    def add(self, groups: Sequence[Group]) -> None:
        """The step's scored base groups. Groups added after round 0 are not decided for, but count in the
        opportunity of doing nothing and in the pass rates (fresh groups bought with the budget left)."""
        for g in groups:
            if g.id in self._groups:
                raise ValueError(f"group {g.id!r} was already added this step")
            names = [o.name for o in g.menu]
            if len(set(names)) != len(names) or NONE in names:
                raise ValueError(f"group {g.id}: intervention names must be unique and not {NONE!r}, got {names}")
            self._groups[g.id] = g
            self._ran[g.id] = []

    def decide(self, budget: float) -> list[Decision]:
        """This round's decisions, spending at most ``budget`` in total: one per group asked (round 0: every group
        with base rollouts; later rounds: those whose last intervention ran and left them without a success). An
        empty list, or decisions that all do nothing, end the step's rounds."""
        t0 = time.perf_counter()
        r = self.round
        self.round += 1
        asked = [g for g in self._groups.values() if g.rollouts and _asked(r, self._tried(g.id), self._solved(g.id))]
        menus = {g.id: self._affordable(g) for g in asked}
        plan = rung_plan(((g.id, self.s.ladder, self._tried(g.id), self._solved(g.id),
                           actionable(((o.key, o.cost, o) for o in menus[g.id] if o.size == self.s.ladder_size),
                                      None)) for g in asked),
                         budget, self.s.heuristic_escalates)
        contexts = [Context(g.id, self._context(g, budget, r),
                            [replace(o, features={**o.features, "cost_share": o.cost / self.step_budget})
                             for o in menus[g.id]],
                            heuristic=plan[g.id][1].name if g.id in plan else None) for g in asked]
        out = []
        for d, g in zip(self.ctl.decide(contexts, budget, tag=f"s{self.step}-"), asked):
            by_name = {o.name: o for o in menus[g.id]}
            d = replace(d, round=r, intervention=by_name[d.intervention.name] if d.intervenes else None,
                        heuristic=plan[g.id][1] if g.id in plan else None)
            self._made.append((d, list(self._ran[g.id])))
            self._by_id[d.id] = d
            out.append(d)
        self.seconds += time.perf_counter() - t0
        return out

    def ran(self, decision_id: str, rollouts: Sequence[Rollout], cost: float) -> None:
        """The intervention of ``decision_id`` ran: its scored rollouts (in order) and what it cost. An intervening
        decision never reported here (it did not fit, or the trainer skipped it) teaches nothing."""
        t0 = time.perf_counter()
        d = self._by_id.get(decision_id)
        if d is None or d.intervention is None:
            raise KeyError(f"{decision_id!r} is not an intervention decided this step")
        if decision_id in self._outcomes:
            raise KeyError(f"{decision_id!r} was already reported")
        self._outcomes[decision_id] = (list(rollouts), cost)
        self._ran[d.group].append(decision_id)
        self.seconds += time.perf_counter() - t0

    def end_step(self, accepted: Mapping[str, Sequence[bool]] | None = None,
                 absorbed: Mapping[str, float] | None = None) -> None:
        """Reward every decision of the step and learn from it; update the pass rates.

        ``accepted`` (per decision id, per rollout in the order reported) overrides the rollouts' own ``accepted``
        fields, for a trainer whose filters run after the rounds (rail's shift filter). ``absorbed`` (per decision
        id; ``reward = "learning"``) is what the unguided policy takes from its trained rollouts
        (``controller.reward.learning_reward``); a decision without one is rewarded by its signal.
        """
        t0 = time.perf_counter()
        accepted, absorbed = accepted or {}, absorbed or {}
        s = self.s
        base = [g for g in self._groups.values() if g.rollouts]
        per_rollout = 1.0
        if s.budget_unit == "tokens":
            gen = [r.tokens for g in self._groups.values() for r in g.rollouts]
            per_rollout = max(1.0, sum(gen) / len(gen) if gen else 1.0)
        unit = s.unit * per_rollout
        opp = R.opportunity([[r.reward for r in g.rollouts] for g in base], s.group_size * per_rollout, unit,
                            [self._headroom(g) for g in base])

        def kept(eid: str) -> list[Rollout]:
            rs, _ = self._outcomes[eid]
            acc = accepted.get(eid) or [x.accepted for x in rs]
            if len(acc) != len(rs):
                raise ValueError(f"{eid}: {len(acc)} accepted flags for {len(rs)} rollouts")
            return [x for x, a in zip(rs, acc) if a]

        for d, earlier in self._made:
            if d.intervention is None:
                self.ctl.feedback(d.id, opp, {"opportunity": opp})
                continue
            if d.id not in self._outcomes:
                self.ctl.abandon(d.id)
                continue
            g = self._groups[d.group]
            rollouts, cost = self._outcomes[d.id]
            keep = kept(d.id)
            acc_rewards = [x.reward for x in keep]
            before = [x.reward for x in g.rollouts if x.accepted]
            for e in earlier:
                before += [x.reward for x in kept(e)]
            h = self._headroom(g)
            outcome = {"cost": cost, "rollouts": len(rollouts), "accepted": len(acc_rewards),
                       "successes": sum(1 for x in keep if x.success), "headroom": round(h, 6)}
            a = absorbed.get(d.id) if s.reward == "learning" else None
            if a is not None:
                if a > 0:  # the typical positive absorption: an EMA from the first one on
                    self.absorbed_scale = a if self.absorbed_scale is None else 0.9 * self.absorbed_scale + 0.1 * a
                scale = self.absorbed_scale if self.absorbed_scale is not None else 1.0
                r = R.learning_reward(before, acc_rewards, max(cost, 1), unit, a, scale, s.compose, headroom=h)
                outcome["absorbed"] = a
            else:
                r = R.reward(before, acc_rewards, max(cost, 1), unit, s.compose, headroom=h)
            self.ctl.feedback(d.id, r, outcome)
        w = s.pass_rate_weight
        for g in base:  # drift made visible: the recent pass rate per family/level
            rate = base_pass(g)
            self.pass_rate[g.cell] = (1 - w) * self.pass_rate.get(g.cell, rate) + w * rate
        self._made, self._by_id, self._outcomes = [], {}, {}
        self.seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ what a group looks like
    def _tried(self, gid: str) -> list[str]:
        """The keys of the interventions that ran on group ``gid`` this step, in order."""
        return [self._by_id[e].intervention.key for e in self._ran[gid]]

    def _solved(self, gid: str) -> bool:
        """Whether group ``gid`` has a success: a base rollout, or one of an intervention that ran on it."""
        return any(r.success for r in self._groups[gid].rollouts) or any(
            x.success for e in self._ran[gid] for x in self._outcomes[e][0])

    def _affordable(self, g: Group) -> list[Intervention]:
        """Its interventions within its capacity, less what ran on it."""
        room = None if g.capacity is None else g.capacity - sum(self._outcomes[e][1] for e in self._ran[g.id])
        return [o for o in g.menu if fits(o.cost, room)]

    def _recent_pass(self, g: Group) -> float:
        """The recent unguided pass rate of the group's family/level (before this step's update); a family/level
        seen for the first time uses the group's own base rollouts."""
        return self.pass_rate.get(g.cell, base_pass(g))

    def _headroom(self, g: Group) -> float:
        """1 - the recent pass rate its context saw."""
        return min(1.0, max(0.0, 1.0 - self._recent_pass(g)))

    def _context(self, g: Group, budget: float, rnd: int) -> dict:
        if g.id not in self._static:
            self._static[g.id] = self._static_context(g)
        tried = self._tried(g.id)
        return {**self._static[g.id], "budget_left": budget / self.step_budget, "round": float(rnd),
                "tried": float(len(tried)), "last_tried": tried[-1] if tried else "none"}

    def _static_context(self, g: Group) -> dict:
        """The part of a group's context that holds for the whole step."""
        base = g.rollouts
        rewards = [r.reward for r in base]
        n = len(rewards)
        mean = sum(rewards) / n if n else 0.0
        prog = [r.progress for r in base if r.progress is not None]
        src = branch_source(base)
        made = sum(r.tool_calls for r in base)
        n_lp = sum(len(r.logprobs) for r in base)
        return {
            "family": g.family, "level": str(g.level), "family_level": g.cell,
            "successes": float(sum(1 for r in base if r.success)), "success_rate": mean,
            "reward_spread": (sum((x - mean) ** 2 for x in rewards) / n) ** 0.5 if n else 0.0,
            "progress_mean": sum(prog) / len(prog) if prog else 0.0, "progress_max": max(prog) if prog else 0.0,
            "violated_item": "none" if src is None else str(base[src].violated_item),
            "violated_turn": 0.0 if src is None else float(base[src].violated_turn or 0),
            "tool_failure_rate": (sum(r.tool_failures for r in base) / made) if made else 0.0,
            "logprob_mean": sum(chain.from_iterable(r.logprobs for r in base)) / n_lp if n_lp else 0.0,
            "pass_rate": self._recent_pass(g),
            "train_progress": self.step / self.total_steps,
        }

    # ------------------------------------------------------------------ reporting and state
    def reuse(self, trace: str | os.PathLike) -> dict:
        """Start from an earlier run's learned controller (its ``decisions.dsjson``; :meth:`LearnedController.reuse`):
        before this run's first step. The summary says what was reused."""
        self.reused = self.ctl.reuse(trace)
        return self.reused

    @property
    def mode(self) -> str:
        return self.ctl.mode

    def metrics(self) -> dict[str, float]:
        """``controller/*`` metrics (docs/metrics.md) after ``end_step``."""
        ev = self.ctl.last_gate or {}
        m = {"controller/live": 1.0 if self.ctl.mode == "live" else 0.0,
             "controller/events": float(self.ctl.learned),
             "controller/transitions": float(len(self.ctl.transitions)),
             "controller/seconds": self.seconds}
        for k in ("diff", "diff_lower", "diff_upper", "bandit_dr", "heuristic_dr", "logged"):
            if k in ev:
                m[f"controller/{k}"] = float(ev[k])
        return m

    def summary(self) -> dict:
        out = {"mode": self.ctl.mode, "events": self.ctl.learned, "transitions": self.ctl.transitions,
               "last_gate": self.ctl.last_gate, "seconds": round(self.seconds, 3),
               "trace": str(self.ctl.trace_path) if self.ctl.trace_path else None}
        if self.reused:
            out["reused"] = {k: self.reused[k] for k in ("trace", "events", "mode")}
        return out

    def state_dict(self) -> dict:
        """Everything needed to continue (between steps): the bandit, gate and counters, and the pass rates."""
        if self._made:
            raise RuntimeError("state_dict: a step is in progress; save after end_step")
        return {"learned": self.ctl.state_dict(), "pass_rate": self.pass_rate, "seconds": self.seconds,
                "reused": self.reused, "absorbed_scale": self.absorbed_scale}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; the trace is cut back to the events that state had learned."""
        if state:
            self.ctl.load_state_dict(state["learned"])
            self.pass_rate = dict(state.get("pass_rate", {}))
            self.seconds = float(state.get("seconds", 0.0))
            self.reused = state.get("reused")
            self.absorbed_scale = state.get("absorbed_scale")

    def save(self, path: str | os.PathLike) -> None:
        """The state and the settings, as one JSON file written atomically."""
        write_atomic(Path(path), json.dumps({"settings": asdict(self.s), "seed": self.seed,
                                             "state": self.state_dict()}))

    @classmethod
    def load(cls, path: str | os.PathLike, trace_dir: str | os.PathLike | None = None) -> "Session":
        try:
            saved = json.loads(Path(path).read_text())
            settings = SessionSettings(**saved["settings"])
            seed, state = int(saved["seed"]), saved["state"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a controller session file ({e})") from None
        s = cls(settings, seed=seed, trace_dir=trace_dir)
        s.load_state_dict(state)
        return s
