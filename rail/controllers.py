"""Intervention controllers, chosen by name (``--controller``).

After a step's base rollouts are scored, the training loop runs rounds: it hands the controller every group
(base rollouts plus whatever earlier rounds added) and the step's remaining budget; the controller returns
:class:`Decision` objects; the loop prices each one (:class:`Menu`), runs those that fit the budget — all of
a round's decisions in one batched generation — scores them, appends them to their groups and reports them
back with :meth:`Controller.observe`. Rounds end when the controller returns nothing. Whatever budget is
left is then spent on fresh base groups, so every controller spends the same budget per step.

Fixed controllers (the baselines a learned controller must beat):

- ``none`` — plain GRPO: the whole budget on base groups.
- ``dapo`` — dynamic sampling: half the budget on base groups, then a fresh group for every zero-variance one.
- ``rti`` — a rubric hint at the first violation for every group without a success, fixed how_many.
- ``actguide`` — fallback for groups whose every rollout scored 0: a binary search over the plan length with
  probe rollouts (charged, not trained), then a full group of guided rollouts that replaces the group.
- ``ladder`` — minimal intervention: the cheapest operator first, escalating while the group has no success.
- ``random`` — uniform over the legal interventions of every group (and doing nothing).

The learned controller, ``rail``, wraps ``controller.LearnedController`` (docs/controller.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from rail.interventions import Intervention


@dataclass
class GroupView:
    """What a controller sees of one group: its task and every rollout so far (base first)."""

    group: int
    family: str
    task: Any
    trajectories: list  # policy.records.Trajectory: base rollouts, then intervention rollouts
    n_base: int = 0
    zero_variance_base: bool = False  # the base rollouts alone carried no signal
    interventions: list = field(default_factory=list)  # Intervention keys applied this step

    @property
    def base(self) -> list:
        return self.trajectories[: self.n_base]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories if not _is_probe(t)]

    @property
    def successes(self) -> int:
        return sum(1 for r in self.rewards if r >= 1.0)

    @property
    def all_zero(self) -> bool:
        return all(r == 0.0 for r in self.rewards)


def _is_probe(t) -> bool:
    return t.intervention is not None and bool(t.intervention.get("probe"))


def _accepted(t) -> bool:
    """After the learner's filters: a rollout that joined its group (not a probe, not shift-rejected)."""
    return t.status not in ("shift_rejected", "probe")


@dataclass
class Decision:
    """Run ``intervention`` on ``group`` (or, with ``refill``, generate a fresh base group instead)."""

    group: int
    intervention: Intervention | None = None
    refill: bool = False
    probe: bool = False  # rollouts are charged but not trained on
    propensity: float = 1.0
    info: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """What a decision produced (``ran`` is False when it did not fit the budget or was not legal)."""

    decision: Decision
    ran: bool
    cost: int = 0
    trajectories: list = field(default_factory=list)

    @property
    def successes(self) -> int:
        return sum(1 for t in self.trajectories if t.reward >= 1.0)


class Menu:
    """The legal interventions of a group and their costs, as the training loop prices them.

    ``legal(view)`` lists the configured menu's interventions that can act on the group; ``cost(view, iv)``
    is what running ``iv`` would charge (None when it is not legal); ``refill_cost`` is a fresh base group.
    """

    def __init__(self, menu: Sequence[Intervention], legal: Callable, cost: Callable, refill_cost: int):
        self.menu = list(menu)
        self._legal, self._cost = legal, cost
        self.refill_cost = refill_cost

    def legal(self, view: GroupView) -> list[Intervention]:
        return self._legal(view, self.menu)

    def cost(self, view: GroupView, iv: Intervention) -> int | None:
        return self._cost(view, iv)


class Controller(Protocol):
    name: str
    compose: str  # how its interventions join their groups: "mix" or "replace"

    def plan_base(self, step_budget: int, group_size: int, unit: str, tokens_per_rollout: float = 1.0) -> int:
        """How many base groups to generate this step."""

    def begin_step(self, step: int, rng: np.random.Generator) -> None: ...

    def decide(self, groups: Sequence[GroupView], remaining: int, unit: str, menu: Menu) -> list[Decision]:
        """This round's interventions, within ``remaining``; an empty list ends the step's rounds."""

    def observe(self, outcomes: Sequence[Outcome]) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _groups_for(budget: float, group_size: int, unit: str, tokens_per_rollout: float) -> int:
    per_rollout = 1.0 if unit == "rollouts" else max(1.0, tokens_per_rollout)
    return max(1, int(budget // (group_size * per_rollout)))


class NoController:
    """Plain GRPO: every rollout of the budget goes to base groups; never intervenes."""

    name = "none"
    compose = "mix"

    def __init__(self, config: Any = None, **_: Any):
        self.cfg = config

    def plan_base(self, step_budget, group_size, unit, tokens_per_rollout=1.0) -> int:
        return _groups_for(step_budget, group_size, unit, tokens_per_rollout)

    def begin_step(self, step, rng) -> None:
        self.rng = rng

    def decide(self, groups, remaining, unit, menu) -> list[Decision]:
        return []

    def observe(self, outcomes) -> None:
        pass

    def feedback(self, groups, outcomes, compose: str) -> None:
        """Called after the learner's filters ran (rollout statuses are set); learned controllers learn here."""

    def metrics(self) -> dict[str, float]:
        return {}

    def summary(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _Reserving(NoController):
    """Spends ``controller.base_share`` of the budget on base groups and keeps the rest for its rounds."""

    def plan_base(self, step_budget, group_size, unit, tokens_per_rollout=1.0) -> int:
        share = self.cfg.controller.base_share if self.cfg is not None else 0.5
        return _groups_for(step_budget * share, group_size, unit, tokens_per_rollout)

    def begin_step(self, step, rng) -> None:
        self.rng, self.round = rng, 0

    def decide(self, groups, remaining, unit, menu) -> list[Decision]:
        out = self._decide(groups, remaining, unit, menu)
        self.round += 1
        return out

    def _decide(self, groups, remaining, unit, menu) -> list[Decision]:
        raise NotImplementedError

    @staticmethod
    def _take(decisions: list[tuple[Decision, int | None]], remaining: int) -> list[Decision]:
        """Decisions in order while their costs fit ``remaining``."""
        out = []
        for d, c in decisions:
            if c is not None and c <= remaining:
                out.append(d)
                remaining -= c
        return out


class DapoController(_Reserving):
    """DAPO dynamic sampling under a fixed budget: replace every zero-variance group by a fresh one."""

    name = "dapo"

    def _decide(self, groups, remaining, unit, menu):
        seen = getattr(self, "_refilled", set()) if self.round else set()
        todo = [g for g in groups if g.zero_variance_base and g.group not in seen]
        self._refilled = seen | {g.group for g in todo}
        return self._take([(Decision(g.group, refill=True), menu.refill_cost) for g in todo], remaining)


class RtiController(_Reserving):
    """RTI: a rubric hint at the first violation for every group without a success (one round)."""

    name = "rti"

    def _decide(self, groups, remaining, unit, menu):
        if self.round:
            return []
        iv = Intervention("rubric_hint", "violation", self.cfg.controller.rti_how_many)
        todo = [(Decision(g.group, iv), menu.cost(g, iv)) for g in groups if g.successes == 0]
        return self._take(todo, remaining)


class LadderController(_Reserving):
    """Minimal intervention: each round, every group still without a success climbs one rung."""

    name = "ladder"

    def begin_step(self, step, rng) -> None:
        super().begin_step(step, rng)
        self.rung: dict[int, int] = {}

    def _decide(self, groups, remaining, unit, menu):
        rungs = [Intervention.parse(r, self.cfg.controller.ladder_how_many) for r in self.cfg.controller.ladder]
        todo = []
        for g in groups:
            if g.successes > 0:
                continue
            k = self.rung.get(g.group, 0)
            while k < len(rungs) and menu.cost(g, rungs[k]) is None:  # skip rungs that cannot act here
                k += 1
            if k < len(rungs):
                todo.append((g.group, k, Decision(g.group, rungs[k]), menu.cost(g, rungs[k])))
        out = []
        for gi, k, d, c in todo:
            if c <= remaining:
                out.append(d)
                remaining -= c
                self.rung[gi] = k + 1
        return out


class ActGuideController(_Reserving):
    """ActGuide fallback: for groups whose every rollout scored 0, binary-search the smallest plan length with
    any success (probe rollouts), then replace the group with ``group_size`` guided rollouts at that length."""

    name = "actguide"
    compose = "replace"

    def begin_step(self, step, rng) -> None:
        super().begin_step(step, rng)
        self.search: dict[int, dict] = {}

    def _decide(self, groups, remaining, unit, menu):
        c = self.cfg.controller
        out: list[tuple[Decision, int | None]] = []
        for g in groups:
            if g.group not in self.search:
                if g.n_base == 0 or not all(t.reward == 0.0 for t in g.base) or g.interventions:
                    continue
                L = len(g.task.action_guide)
                self.search[g.group] = {"lo": 1, "hi": L, "probes": 0, "found": False, "done": False, "L": L}
            s = self.search[g.group]
            if s["done"]:
                continue
            if s["lo"] < s["hi"] and s["probes"] < c.max_probes:
                m = (s["lo"] + s["hi"]) // 2
                iv = Intervention("action_guide", "start", c.probe_rollouts, plan_len=m)
                out.append((Decision(g.group, iv, probe=True, info={"plan_len": m}), menu.cost(g, iv)))
            else:
                s["done"] = True
                if s["found"] or s["lo"] == s["L"]:
                    iv = Intervention("action_guide", "start", self.cfg.budget.group_size, plan_len=s["lo"])
                    out.append((Decision(g.group, iv), menu.cost(g, iv)))
        return self._take(out, remaining)

    def observe(self, outcomes) -> None:
        for o in outcomes:
            d = o.decision
            s = self.search.get(d.group)
            if s is None or not d.probe:
                continue
            if not o.ran:
                s["done"] = True  # out of budget: stop searching this group
                continue
            s["probes"] += 1
            if o.successes > 0:
                s["hi"], s["found"] = d.info["plan_len"], True
            else:
                s["lo"] = d.info["plan_len"] + 1


class RandomController(_Reserving):
    """Uniform over each group's legal interventions and doing nothing, groups in random order (one round)."""

    name = "random"

    def _decide(self, groups, remaining, unit, menu):
        if self.round:
            return []
        out = []
        for gi in self.rng.permutation(len(groups)):
            g = groups[int(gi)]
            options: list[Intervention | None] = [None, *menu.legal(g)]
            pick = options[int(self.rng.integers(len(options)))]
            if pick is not None:
                out.append((Decision(g.group, pick, propensity=1.0 / len(options)), menu.cost(g, pick)))
        return self._take(out, remaining)


CONTROLLERS: dict[str, type] = {
    "none": NoController,
    "dapo": DapoController,
    "rti": RtiController,
    "actguide": ActGuideController,
    "ladder": LadderController,
    "random": RandomController,
}


class RailController(_Reserving):
    """The learned controller (``controller/``), shadowing the ``controller.shadow`` heuristic until off-policy
    evaluation promotes it (docs/controller.md). Round 0 decides for every base group; with
    ``controller.escalate``, each later round decides again for the groups its last intervention left without
    a success (as ``ladder`` climbs a rung), and the shadowed heuristic is ladder's next untried rung."""

    name = "rail"

    def __init__(self, config: Any = None, out: Any = None, **_: Any):
        super().__init__(config)
        from pathlib import Path

        from controller import LearnedController, Settings

        c = config.controller
        self.settings = Settings(epsilon=c.epsilon, heuristic_epsilon=c.heuristic_epsilon, lr=c.bandit_lr,
                                 mode=c.start_mode, window=c.window, min_events=c.min_events,
                                 check_every=c.check_every, margin=c.margin, consecutive=c.consecutive)
        trace_dir = None if out is None else Path(out) / "traces"
        self.ctl = LearnedController(self.settings, seed=config.run.seed, trace_dir=trace_dir)
        self.pass_rate: dict[str, float] = {}  # EMA of base success per family/level
        self.seconds = 0.0
        self.step = 0
        self._made: list = []  # (controller decision, rail Decision or None, view, the group's rollouts before it)
        self.absorbed: list[float] = []  # this step's interventions: what their demonstrations revealed

    def begin_step(self, step, rng) -> None:
        super().begin_step(step, rng)
        self.step, self._made, self.absorbed = step, [], []

    def _context(self, g: GroupView, remaining: int) -> dict:
        base = g.base
        rewards = [t.reward for t in base]
        n = len(rewards)
        mean = sum(rewards) / n if n else 0.0
        prog = [t.rubric.progress for t in base if t.rubric is not None]
        from rail.interventions import source_index

        src = source_index(base)
        calls = [t.tool_calls() for t in base]
        made = sum(c for c, _ in calls)
        lps = [lp for t in base for lp, o in zip(t.logprobs, t.origin) if o == 0]
        return {
            "family": g.family, "level": str(g.task.level), "family_level": self._cell(g),
            "successes": float(sum(r >= 1.0 for r in rewards)), "success_rate": mean,
            "reward_spread": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5 if n else 0.0,
            "progress_mean": sum(prog) / len(prog) if prog else 0.0, "progress_max": max(prog) if prog else 0.0,
            "violated_item": "none" if src is None else str(base[src].rubric.first_violated),
            "violated_turn": 0.0 if src is None else float(base[src].rubric.violated_turn or 0),
            "tool_failure_rate": (sum(f for _, f in calls) / made) if made else 0.0,
            "logprob_mean": sum(lps) / len(lps) if lps else 0.0,
            "pass_rate": self._recent_pass(g),
            "train_progress": self.step / max(1, self.cfg.run.steps),
            "budget_left": remaining / max(1, self.cfg.step_budget()),
            "round": float(self.round), "tried": float(len(g.interventions)),
            "last_tried": g.interventions[-1] if g.interventions else "none",
        }

    def _heuristic(self, g: GroupView, menu: Menu) -> Intervention | None:
        """The shadowed heuristic's choice for a group without a success: ``ladder``'s first legal rung not yet
        tried on it this step, or ``rti``'s hint (first round only); otherwise nothing."""
        c = self.cfg.controller
        if g.successes > 0:
            return None
        if c.shadow == "rti":
            cands = [] if g.interventions else [Intervention("rubric_hint", "violation", c.rti_how_many)]
        else:
            cands = [Intervention.parse(r, c.ladder_how_many) for r in c.ladder]
            cands = [iv for iv in cands if iv.key not in g.interventions]
        return next((iv for iv in cands if menu.cost(g, iv) is not None), None)

    def _decide(self, groups, remaining, unit, menu):
        import time

        from controller import Action, Group

        if self.round and not self.cfg.controller.escalate:
            return []
        t0 = time.perf_counter()
        requests, views, by_name = [], [], []
        for g in groups:
            # round r asks every group whose decisions of rounds 0 .. r-1 all intervened and ran (one applied
            # intervention per round) and, after round 0, that still has no success
            if g.n_base == 0 or len(g.interventions) != self.round or (self.round and g.successes > 0):
                continue
            costs = {iv: menu.cost(g, iv) for iv in menu.legal(g)}
            options = {iv.name: iv for iv in costs}
            step_budget = max(1, self.cfg.step_budget())
            acts = [Action(iv.name, {**iv.features(), "cost_share": c / step_budget}, float(c)) for iv, c in costs.items()]
            h = self._heuristic(g, menu)
            requests.append(Group(f"g{g.group}", self._context(g, remaining), acts,
                                  heuristic=h.name if h is not None and h.name in options else None))
            views.append(g)
            by_name.append(options)
        made = self.ctl.decide(requests, remaining, tag=f"s{self.step}-")
        out = []
        for d, g, options in zip(made, views, by_name):
            rd = None if not d.intervenes else Decision(g.group, options[d.action.name], propensity=d.propensity,
                                                        info={"event": d.id, "mode": d.mode})
            self._made.append((d, rd, g, list(g.trajectories)))
            if rd is not None:
                out.append(rd)
        self.seconds += time.perf_counter() - t0
        return out

    def feedback(self, groups, outcomes, compose: str) -> None:
        """Rewards for this step's decisions, once the learner has said which rollouts it accepted."""
        import time

        import controller.reward as R

        t0 = time.perf_counter()
        g_size = self.cfg.budget.group_size
        unit_rollouts = float(min(self.cfg.controller.how_many))
        per_rollout = 1.0 if self.cfg.budget.unit == "rollouts" else max(1.0, self._tokens_per_rollout(groups))
        unit = unit_rollouts * per_rollout
        base = [g for g in groups if g.n_base]
        weighted = self.cfg.controller.headroom
        opp = R.opportunity([[t.reward for t in g.base] for g in base], g_size * per_rollout, unit,
                            [self._headroom(g) for g in base] if weighted else None)
        # demonstrations count only when the learner distils them (docs/controller.md, "Reward")
        weight = self.cfg.controller.absorption if self.cfg.learner.guided_sft > 0 else 0.0
        ran = {id(o.decision): o for o in outcomes if o.ran}
        for d, rd, g, earlier in self._made:
            if rd is None:
                self.ctl.feedback(d.id, opp, {"opportunity": opp})
                continue
            o = ran.get(id(rd))
            if o is None:
                self.ctl.abandon(d.id)
                continue
            kept = [t for t in o.trajectories if _accepted(t)]
            accepted = [t.reward for t in kept]
            shifts = [t.shift if t.context_shifted else None for t in kept]
            n_run = sum(t.status != "probe" for t in o.trajectories)
            before = [t.reward for t in earlier if _accepted(t)]
            h = self._headroom(g)  # logged either way; it weights the reward with controller.headroom
            r = R.reward(before, accepted, max(o.cost, 1), unit, compose, shifts=shifts, ran=n_run, weight=weight,
                         headroom=h if weighted else 1.0)
            absorbed = R.absorbed(before, accepted, shifts, n_run, compose) if weight > 0 else 0.0
            self.absorbed.append(absorbed)
            self.ctl.feedback(d.id, r, {"cost": o.cost, "rollouts": len(o.trajectories), "accepted": len(accepted),
                                        "successes": sum(x >= 1.0 for x in accepted),
                                        "absorbed": round(absorbed, 6), "headroom": round(h, 6)})
        for g in groups:  # drift made visible: the recent pass rate per family/level
            if g.n_base:
                key, rate = self._cell(g), self._base_pass(g)
                self.pass_rate[key] = 0.9 * self.pass_rate.get(key, rate) + 0.1 * rate
        self._made = []
        self.seconds += time.perf_counter() - t0

    @staticmethod
    def _cell(g: GroupView) -> str:
        """The key of the group's kind of task in the recent pass rates: its family/level."""
        return f"{g.family}/{g.task.level}"

    @staticmethod
    def _base_pass(g: GroupView) -> float:
        return sum(t.reward >= 1.0 for t in g.base) / g.n_base

    def _recent_pass(self, g: GroupView) -> float:
        """The recent unguided pass rate of the group's family/level (before this step's update); a family/level
        seen for the first time uses the group's own base rollouts. Its context's ``pass_rate``."""
        return self.pass_rate.get(self._cell(g), self._base_pass(g))

    def _headroom(self, g: GroupView) -> float:
        """1 - the recent pass rate its context saw."""
        return min(1.0, max(0.0, 1.0 - self._recent_pass(g)))

    @staticmethod
    def _tokens_per_rollout(groups) -> float:
        gen = [t.n_generated for g in groups for t in g.base]
        return sum(gen) / len(gen) if gen else 1.0

    def metrics(self) -> dict[str, float]:
        ev = self.ctl.last_gate or {}
        m = {"controller/live": 1.0 if self.ctl.mode == "live" else 0.0,
             "controller/events": float(self.ctl.learned),
             "controller/transitions": float(len(self.ctl.transitions)),
             "controller/seconds": self.seconds}
        if self.absorbed:
            m["controller/absorbed"] = sum(self.absorbed) / len(self.absorbed)
        for k in ("diff", "diff_lower", "diff_upper", "bandit_dr", "heuristic_dr", "logged"):
            if k in ev:
                m[f"controller/{k}"] = float(ev[k])
        return m

    def summary(self) -> dict:
        return {"mode": self.ctl.mode, "events": self.ctl.learned, "transitions": self.ctl.transitions,
                "last_gate": self.ctl.last_gate, "seconds": round(self.seconds, 3),
                "trace": str(self.ctl.trace_path) if self.ctl.trace_path else None}

    def state_dict(self) -> dict:
        return {"learned": self.ctl.state_dict(), "pass_rate": self.pass_rate, "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.ctl.load_state_dict(state["learned"])
            self.pass_rate = dict(state.get("pass_rate", {}))
            self.seconds = float(state.get("seconds", 0.0))


CONTROLLERS["rail"] = RailController
