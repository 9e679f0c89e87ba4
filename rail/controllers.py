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

The learned controller, ``rail``, translates rail's groups, menu and outcomes for ``controller.Session``, the seam any
trainer drives (docs/controller.md).
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
    capacity: float | None = None  # the most its interventions may cost this step (TRL: its free slots); None: no cap

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


def make_menu(cfg: Any, envs: dict, runners: dict, tokens_per_rollout: float = 0.0) -> Menu:
    """The configured menu (``controller.menu`` x ``controller.how_many``) priced by :func:`rail.interventions.plan`
    for the groups of one step: rail's training loop and the TRL adapter (``rail.integrations.trl``) both use it.
    ``menu.plan_for(view, iv, probe=False)`` is the plan itself (cached per group, intervention and group size);
    ``tokens_per_rollout`` prices a fresh base group in a token budget."""
    from rail import interventions

    c, unit = cfg.controller, cfg.budget.unit
    items = [Intervention.parse(m, k) for m in c.menu for k in c.how_many]
    cache: dict = {}

    def plan_for(view: GroupView, iv: Intervention, probe: bool = False):
        key = (view.group, iv, probe, len(view.trajectories))
        if key not in cache:
            cache[key] = interventions.plan(iv, view.group, view.base, view.task, runners[view.family],
                                            envs[view.family].system_prompt(), unit,
                                            cfg.rollout.max_tokens_per_turn, probe=probe)
        return cache[key]

    def legal(view, menu):
        return interventions.legal(view.base, menu)

    def cost(view, iv):
        p = plan_for(view, iv)
        return None if p is None else p.cost

    refill = cfg.budget.group_size if unit == "rollouts" else int(
        cfg.budget.group_size * (tokens_per_rollout or cfg.max_rollout_tokens / 4))
    m = Menu(items, legal, cost, refill)
    m.plan_for = plan_for
    return m


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
    """The learned controller, shadowing the ``controller.shadow`` heuristic until off-policy evaluation promotes
    it (docs/controller.md). A translation from rail's groups, menu and outcomes to the trainer-agnostic
    :class:`controller.Session`, which holds every rule: the context, the menu as bandit actions, the shadowed
    heuristic (ladder's next untried rung), escalation rounds, the reward, pass rates, traces and state."""

    name = "rail"

    def __init__(self, config: Any = None, out: Any = None, **_: Any):
        super().__init__(config)
        from pathlib import Path

        from controller import Session, SessionSettings, Settings
        from rail.settings import settings_from

        c = config.controller
        self.settings = settings_from(Settings, c)  # the bandit and its gate: [controller] fields of the same names
        if c.shadow == "rti":  # RTI: one hint, on a group nothing was tried on
            ladder, size, escalates = [Intervention.parse("rubric_hint@violation", 1).key], c.rti_how_many, False
        else:
            ladder, size, escalates = [Intervention.parse(r, 1).key for r in c.ladder], c.ladder_how_many, True
        session = SessionSettings(
            bandit=self.settings, ladder=tuple(ladder), ladder_size=size, heuristic_escalates=escalates,
            group_size=config.budget.group_size, unit=float(min(c.how_many)), budget_unit=config.budget.unit,
            compose=c.compose if c.compose != "auto" else self.compose)
        trace_dir = None if out is None else Path(out) / "traces"
        self.session = Session(session, seed=config.run.seed, trace_dir=trace_dir)
        self.ctl = self.session.ctl
        self.seconds = 0.0  # the controller's own time: the session's and this translation's
        self._views: dict[str, GroupView] = {}
        self._event: dict[int, str] = {}  # id(rail Decision) -> the session's event id

    def begin_step(self, step, rng) -> None:
        super().begin_step(step, rng)
        self.session.begin_step(step, self.cfg.run.steps, self.cfg.step_budget())
        self._views, self._event = {}, {}

    def _add(self, groups: Sequence[GroupView], menu: Menu | None) -> None:
        """Groups the session has not seen, as scored records with their legal, priced options."""
        from controller import Option, ScoredGroup

        new = []
        for g in groups:
            gid = f"g{g.group}"
            if gid in self._views:
                continue
            self._views[gid] = g
            options = []
            if menu is not None and g.n_base:
                for iv in menu.legal(g):
                    c = menu.cost(g, iv)
                    options.append(Option(iv.name, iv.key, iv.how_many, c, iv.features(), ref=iv))
            new.append(ScoredGroup(gid, g.family, g.task.level, [_record(t, menu is not None) for t in g.base],
                                   options, capacity=g.capacity))
        self.session.add(new)

    def _decide(self, groups, remaining, unit, menu):
        import time

        t0 = time.perf_counter()
        if self.round == 0:
            self._add(groups, menu)
        choices = self.session.decide(remaining)
        out = []
        for ch in choices:
            if ch.intervenes:
                d = Decision(self._views[ch.group].group, ch.option.ref, propensity=ch.propensity,
                             info={"event": ch.id, "mode": ch.mode})
                self._event[id(d)] = ch.id
                out.append(d)
        self.seconds += time.perf_counter() - t0
        return out

    def observe(self, outcomes) -> None:
        """A round's interventions that ran: their scored rollouts reach the session (escalation reads them)."""
        import time

        t0 = time.perf_counter()
        for o in outcomes:
            eid = self._event.get(id(o.decision))
            if eid is not None and o.ran:
                self.session.ran(eid, [_record(t, False) for t in o.trajectories], o.cost)
        self.seconds += time.perf_counter() - t0

    def feedback(self, groups, outcomes, compose: str) -> None:
        """Rewards for this step's decisions, once the learner has said which rollouts it accepted (``compose``
        is the session's, resolved from the same config)."""
        import time

        t0 = time.perf_counter()
        self._add(groups, None)  # fresh groups bought with what the rounds left: the opportunity, pass rates
        accepted = {}
        for o in outcomes:
            eid = self._event.get(id(o.decision))
            if eid is not None:
                accepted[eid] = [_accepted(t) for t in o.trajectories]
        self.session.end_step(accepted)
        self._views, self._event = {}, {}
        self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {**self.session.metrics(), "controller/seconds": self.seconds}

    def summary(self) -> dict:
        return {**self.session.summary(), "seconds": round(self.seconds, 3)}

    def state_dict(self) -> dict:
        return {**self.session.state_dict(), "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.session.load_state_dict(state)
            self.seconds = float(state.get("seconds", 0.0))


def _record(t, logprobs: bool):
    """A rollout as the controller's seam records it (rail's success: reward 1). Only the context of a group
    decided for reads behaviour log-probs."""
    from controller import Rollout

    rb = t.rubric
    calls, failed = t.tool_calls()
    lps = [lp for lp, o in zip(t.logprobs, t.origin) if o == 0] if logprobs else ()
    return Rollout(t.reward, t.reward >= 1.0, None if rb is None else rb.progress,
                   None if rb is None else rb.first_violated, None if rb is None else rb.violated_turn,
                   calls, failed, lps, t.n_generated)


CONTROLLERS["rail"] = RailController
