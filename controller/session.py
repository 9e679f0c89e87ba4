"""The controller seam: what a trainer hands the learned controller in a training step and what it gets back.

Any GRPO-style trainer (rail's own, TRL's ``GRPOTrainer`` through a ``rollout_func``, a verl agent loop, a
home-grown loop) drives one :class:`Session` with plain records; nothing here knows about models, tokens or
torch. One step::

    s.begin_step(step, total_steps, step_budget)
    s.add([Group(...), ...])           # the step's scored base groups, each with its legal, priced options
    while True:                              # rounds
        choices = s.decide(budget_left)      # a Choice for every group asked this round
        if not any(c.intervenes for c in choices):
            break
        for c in choices:
            if c.intervenes:                 # run c.option (c.option.ref is the trainer's own object for it)
                s.ran(c.id, rollouts, cost)  # its scored rollouts and what it actually cost
    s.end_step()                             # rewards, learning, traces, the gate, pass rates

and between steps ``state_dict()`` / ``load_state_dict()`` (or ``save`` / ``load``) with the trainer's
checkpoints. What the session does for the trainer (``docs/controller.md``, "Using the controller in another
trainer"):

* **the context** of a group, built from its base rollouts (family, level, successes, reward spread, rubric
  progress, the first violated item and its turn of the rollout an intervention would branch from, tool
  failures, mean behaviour log-prob), the recent pass rate of its family/level, training progress, the budget
  left and, in later rounds, what was already tried on it;
* **the menu as bandit actions**: the trainer's options (``how@where`` key, size, cost, features) plus doing
  nothing, with the option's share of the step budget as a feature; options beyond a group's ``capacity``
  (TRL: its free slots) are left out;
* **the shadowed heuristic** and **who is asked each round**: the rung rule of :mod:`controller.heuristic`, the
  same function rail's ``ladder`` and ``rti`` controllers run: round 0 asks every group added before it, each
  later round the groups whose intervention in the round before ran and left them without a success; the
  heuristic takes the ladder's first untried rung among the group's options at the ladder's size (or, not
  escalating, RTI's one hint), nothing for a group with a success;
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
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Mapping, Sequence

from controller import reward as R
from controller.heuristic import asked as _asked, next_rung
from controller.core import NONE, Arm, Query, LearnedController, Settings, write_atomic


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
class Option:
    """A legal intervention on a group, priced before anything runs."""

    name: str  # unique within the group; names the action in traces
    key: str  # operator and branch point, "how@where": what the heuristic's ladder and ``tried`` speak of
    size: int  # rollouts it runs
    cost: float  # in the budget's unit (rollouts or tokens)
    features: dict = field(default_factory=dict)  # action features for the bandit (strings categorical)
    ref: Any = None  # the trainer's own object for it, handed back in the Choice; never logged


@dataclass
class Group:
    """One task's group of base rollouts, scored, with its legal options."""

    id: str  # unique within the step; part of every event id
    family: str  # kind of task
    level: int | str  # difficulty; family/level is the cell of the pass-rate EMA
    rollouts: Sequence[Rollout]  # the base (on-policy, unguided) rollouts
    options: Sequence[Option] = ()
    capacity: float | None = None  # the most its interventions may cost this step (TRL: free slots); None: no cap


@dataclass
class Choice:
    """The controller's decision for one group in one round: ``option`` None means do nothing."""

    id: str  # event id: report the outcome under it
    group: str
    option: Option | None
    propensity: float  # the probability with which it was chosen
    mode: str  # "shadow" (the randomised heuristic acted) or "live" (the bandit acted)
    round: int
    heuristic: Option | None = None  # what the shadowed heuristic would do (controller.heuristic), acting or not

    @property
    def intervenes(self) -> bool:
        return self.option is not None


@dataclass
class SessionSettings:
    """What a trainer tells the session once (``docs/controller.md``); the bandit and its gate are ``bandit``."""

    bandit: Settings = field(default_factory=Settings)
    ladder: tuple[str, ...] = ("resample@violation", "rubric_hint@violation", "guided_step@violation",
                               "action_guide@start")  # the shadowed heuristic's rungs (keys), cheapest first
    ladder_size: int = 2  # the heuristic's option size on every rung
    heuristic_escalates: bool = True  # False: the heuristic acts only on a group nothing was tried on (RTI)
    group_size: int = 8  # rollouts of a fresh base group: what doing nothing buys instead
    unit: float = 2.0  # rollouts of the cheapest intervention: the reward's unit of cost
    budget_unit: str = "rollouts"  # or "tokens": costs are tokens; a rollout counts its mean base tokens
    compose: str = "mix"  # intervened rollouts join their group ("mix") or replace its base rollouts ("replace")
    pass_rate_weight: float = 0.1  # weight of a step's own base pass rate in the family/level's EMA

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


def branch_source(rollouts: Sequence[Rollout]) -> int | None:
    """The failed rollout an intervention branches from: most rubric progress, then latest violation, then the
    lowest index; None when no failed rollout violated a rubric item. On a task without a rubric (no progress
    recorded) every failed rollout can be a source: the highest reward, then the lowest index."""
    failed = [i for i, r in enumerate(rollouts) if not r.success and (r.violated_item is not None or r.progress is None)]
    if not failed:
        return None
    return max(failed, key=lambda i: (rollouts[i].reward if rollouts[i].progress is None else rollouts[i].progress or 0.0,
                                      rollouts[i].violated_turn or 0, -i))


class _GroupState:
    """A group's bookkeeping within a step."""

    __slots__ = ("rec", "cell", "n_success", "tried", "ran", "static")

    def __init__(self, rec: Group):
        self.rec = rec
        self.cell = f"{rec.family}/{rec.level}"
        self.n_success = sum(1 for r in rec.rollouts if r.success)  # base and every intervention that ran
        self.tried: list[str] = []  # keys of the interventions that ran on it this step, in order
        self.ran: list[str] = []  # their event ids
        self.static: dict | None = None  # the context's step-constant part

    @property
    def base_pass(self) -> float:
        rs = self.rec.rollouts
        return sum(1 for r in rs if r.success) / len(rs)


class Session:
    """The learned controller for one training run, spoken to in groups, options and outcomes."""

    def __init__(self, settings: SessionSettings | None = None, seed: int = 0,
                 trace_dir: str | os.PathLike | None = None):
        self.s = settings or SessionSettings()
        self.seed = seed
        self.ctl = LearnedController(self.s.bandit, seed=seed, trace_dir=trace_dir)
        self.pass_rate: dict[str, float] = {}  # EMA of base success per family/level
        self.seconds = 0.0  # time spent in the session's own methods
        self.step, self.total_steps, self.step_budget = 0, 1, 1.0
        self.round = 0
        self._groups: dict[str, _GroupState] = {}
        self._made: list[tuple[str, _GroupState, Option | None, list[str]]] = []  # (event, group, option, ran before it)
        self._by_id: dict[str, tuple] = {}
        self._outcomes: dict[str, tuple[list[Rollout], float]] = {}

    # ------------------------------------------------------------------ the step
    def begin_step(self, step: int, total_steps: int, step_budget: float) -> None:
        """Start step ``step`` of ``total_steps`` (training progress is their ratio); ``step_budget`` is what the
        whole step may spend (the option's share of it and the share left are features)."""
        if self._made:
            raise RuntimeError("begin_step: the previous step was not ended (call end_step)")
        self.step, self.total_steps, self.step_budget = step, max(1, total_steps), max(1, step_budget)
        self.round = 0
        self._groups, self._outcomes = {}, {}

    def add(self, groups: Sequence[Group]) -> None:
        """The step's scored base groups. Groups added after round 0 are not decided for, but count in the
        opportunity of doing nothing and in the pass rates (fresh groups bought with the budget left)."""
        for g in groups:
            if g.id in self._groups:
                raise ValueError(f"group {g.id!r} was already added this step")
            names = [o.name for o in g.options]
            if len(set(names)) != len(names) or NONE in names:
                raise ValueError(f"group {g.id}: option names must be unique and not {NONE!r}, got {names}")
            self._groups[g.id] = _GroupState(g)

    def decide(self, budget: float) -> list[Choice]:
        """This round's choices, spending at most ``budget`` in total: one per group asked (round 0: every group
        with base rollouts; later rounds: those whose last intervention ran and left them without a success). An
        empty list, or choices that all do nothing, end the step's rounds."""
        t0 = time.perf_counter()
        r = self.round
        self.round += 1
        asked, requests = [], []
        for gs in self._groups.values():
            rec = gs.rec
            if not rec.rollouts or not _asked(r, gs.tried, gs.n_success > 0):
                continue
            opts = self._affordable(gs)
            acts = [Arm(o.name, {**o.features, "cost_share": o.cost / self.step_budget}, float(o.cost))
                    for o in opts]
            h = self._heuristic(gs, opts)
            requests.append(Query(rec.id, self._context(gs, budget, r), acts, heuristic=h))
            asked.append((gs, {o.name: o for o in opts}))
        made = self.ctl.decide(requests, budget, tag=f"s{self.step}-")
        out = []
        for d, (gs, by_name) in zip(made, asked):
            opt = by_name.get(d.action.name) if d.intervenes else None
            self._made.append((d.id, gs, opt, list(gs.ran)))
            self._by_id[d.id] = self._made[-1]
            h = self._by_name(gs, requests[len(out)].heuristic)
            out.append(Choice(d.id, gs.rec.id, opt, d.propensity, d.mode, r, heuristic=h))
        self.seconds += time.perf_counter() - t0
        return out

    def ran(self, choice_id: str, rollouts: Sequence[Rollout], cost: float) -> None:
        """The intervention of ``choice_id`` ran: its scored rollouts (in order) and what it cost. An intervening
        choice never reported here (it did not fit, or the trainer skipped it) teaches nothing."""
        t0 = time.perf_counter()
        entry = self._by_id.get(choice_id)
        if entry is None or entry[2] is None:
            raise KeyError(f"{choice_id!r} is not an intervention decided this step")
        if choice_id in self._outcomes:
            raise KeyError(f"{choice_id!r} was already reported")
        gs = entry[1]
        self._outcomes[choice_id] = (list(rollouts), cost)
        gs.tried.append(entry[2].key)
        gs.ran.append(choice_id)
        gs.n_success += sum(1 for x in rollouts if x.success)
        self.seconds += time.perf_counter() - t0

    def end_step(self, accepted: Mapping[str, Sequence[bool]] | None = None) -> None:
        """Reward every decision of the step and learn from it; update the pass rates.

        ``accepted`` (per choice id, per rollout in the order reported) overrides the rollouts' own ``accepted``
        fields, for a trainer whose filters run after the rounds (rail's shift filter).
        """
        t0 = time.perf_counter()
        accepted = accepted or {}
        s = self.s
        groups = list(self._groups.values())
        base = [gs for gs in groups if gs.rec.rollouts]
        per_rollout = 1.0
        if s.budget_unit == "tokens":
            gen = [r.tokens for gs in groups for r in gs.rec.rollouts]
            per_rollout = max(1.0, sum(gen) / len(gen) if gen else 1.0)
        unit = s.unit * per_rollout
        opp = R.opportunity([[r.reward for r in gs.rec.rollouts] for gs in base], s.group_size * per_rollout, unit,
                            [self._headroom(gs) for gs in base])

        def kept(eid: str) -> list[Rollout]:
            rs, _ = self._outcomes[eid]
            acc = accepted.get(eid) or [x.accepted for x in rs]
            if len(acc) != len(rs):
                raise ValueError(f"{eid}: {len(acc)} accepted flags for {len(rs)} rollouts")
            return [x for x, a in zip(rs, acc) if a]

        for eid, gs, opt, earlier in self._made:
            if opt is None:
                self.ctl.feedback(eid, opp, {"opportunity": opp})
                continue
            if eid not in self._outcomes:
                self.ctl.abandon(eid)
                continue
            rollouts, cost = self._outcomes[eid]
            keep = kept(eid)
            acc_rewards = [x.reward for x in keep]
            before = [x.reward for x in gs.rec.rollouts if x.accepted]
            for e in earlier:
                before += [x.reward for x in kept(e)]
            h = self._headroom(gs)
            r = R.reward(before, acc_rewards, max(cost, 1), unit, s.compose, headroom=h)
            self.ctl.feedback(eid, r, {"cost": cost, "rollouts": len(rollouts), "accepted": len(acc_rewards),
                                       "successes": sum(1 for x in keep if x.success), "headroom": round(h, 6)})
        w = s.pass_rate_weight
        for gs in base:  # drift made visible: the recent pass rate per family/level
            rate = gs.base_pass
            self.pass_rate[gs.cell] = (1 - w) * self.pass_rate.get(gs.cell, rate) + w * rate
        self._made, self._by_id, self._outcomes = [], {}, {}
        self.seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ what a group looks like
    def _affordable(self, gs: _GroupState) -> list[Option]:
        cap = gs.rec.capacity
        if cap is None:
            return list(gs.rec.options)
        left = cap - sum(self._outcomes[e][1] for e in gs.ran)
        return [o for o in gs.rec.options if o.cost <= left + 1e-9]

    def _recent_pass(self, gs: _GroupState) -> float:
        """The recent unguided pass rate of the group's family/level (before this step's update); a family/level
        seen for the first time uses the group's own base rollouts."""
        return self.pass_rate.get(gs.cell, gs.base_pass)

    def _headroom(self, gs: _GroupState) -> float:
        """1 - the recent pass rate its context saw."""
        return min(1.0, max(0.0, 1.0 - self._recent_pass(gs)))

    def _heuristic(self, gs: _GroupState, options: Sequence[Option]) -> str | None:
        """The shadowed heuristic's option among ``options`` (the group's affordable ones): the rung rule of
        :mod:`controller.heuristic` over the ladder, at the ladder's size; None for nothing."""
        sized = {o.key: o.name for o in options if o.size == self.s.ladder_size}
        key = next_rung(self.s.ladder, gs.tried, sized, gs.n_success > 0, self.s.heuristic_escalates)
        return None if key is None else sized[key]

    @staticmethod
    def _by_name(gs: _GroupState, name: str | None) -> Option | None:
        return None if name is None else next(o for o in gs.rec.options if o.name == name)

    def _context(self, gs: _GroupState, budget: float, rnd: int) -> dict:
        if gs.static is None:
            gs.static = self._static_context(gs)
        return {**gs.static, "budget_left": budget / self.step_budget, "round": float(rnd),
                "tried": float(len(gs.tried)), "last_tried": gs.tried[-1] if gs.tried else "none"}

    def _static_context(self, gs: _GroupState) -> dict:
        """The part of a group's context that holds for the whole step."""
        rec = gs.rec
        base = rec.rollouts
        rewards = [r.reward for r in base]
        n = len(rewards)
        mean = sum(rewards) / n if n else 0.0
        prog = [r.progress for r in base if r.progress is not None]
        src = branch_source(base)
        made = sum(r.tool_calls for r in base)
        n_lp = sum(len(r.logprobs) for r in base)
        return {
            "family": rec.family, "level": str(rec.level), "family_level": gs.cell,
            "successes": float(sum(1 for r in base if r.success)), "success_rate": mean,
            "reward_spread": (sum((x - mean) ** 2 for x in rewards) / n) ** 0.5 if n else 0.0,
            "progress_mean": sum(prog) / len(prog) if prog else 0.0, "progress_max": max(prog) if prog else 0.0,
            "violated_item": "none" if src is None else str(base[src].violated_item),
            "violated_turn": 0.0 if src is None else float(base[src].violated_turn or 0),
            "tool_failure_rate": (sum(r.tool_failures for r in base) / made) if made else 0.0,
            "logprob_mean": sum(chain.from_iterable(r.logprobs for r in base)) / n_lp if n_lp else 0.0,
            "pass_rate": self._recent_pass(gs),
            "train_progress": self.step / self.total_steps,
        }

    # ------------------------------------------------------------------ reporting and state
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
        return {"mode": self.ctl.mode, "events": self.ctl.learned, "transitions": self.ctl.transitions,
                "last_gate": self.ctl.last_gate, "seconds": round(self.seconds, 3),
                "trace": str(self.ctl.trace_path) if self.ctl.trace_path else None}

    def state_dict(self) -> dict:
        """Everything needed to continue (between steps): the bandit, gate and counters, and the pass rates."""
        if self._made:
            raise RuntimeError("state_dict: a step is in progress; save after end_step")
        return {"learned": self.ctl.state_dict(), "pass_rate": self.pass_rate, "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; the trace is cut back to the events that state had learned."""
        if state:
            self.ctl.load_state_dict(state["learned"])
            self.pass_rate = dict(state.get("pass_rate", {}))
            self.seconds = float(state.get("seconds", 0.0))

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
