"""Intervention controllers, chosen by name (``--controller``).

A controller speaks the step protocol of :mod:`rail.rounds` (which rail's loop and every adapter run): after a
step's base rollouts are scored, each round it sees every :class:`~rail.rounds.Group` and the step's remaining
budget and returns :class:`~rail.rounds.Decision` objects; the protocol prices and runs those that fit, and reports
them back with :meth:`Controller.observe`; after the learner's filters, :meth:`feedback`.

Fixed controllers (the baselines a learned controller must beat):

- ``none`` — plain GRPO: the whole budget on base groups.
- ``dapo`` — dynamic sampling: half the budget on base groups, then a fresh group for every zero-variance one.
- ``rti`` — a rubric hint at the first violation for every group without a success, fixed how_many (the rung
  rule of :mod:`controller.heuristic` with one rung, not escalating).
- ``actguide`` — fallback for groups whose every rollout scored 0: a binary search over the plan length with
  probe rollouts (charged, not trained), then a full group of guided rollouts that replaces the group.
- ``ladder`` — minimal intervention: the cheapest operator first, escalating while the group has no success (the
  rung rule of :mod:`controller.heuristic`, exactly what the learned controller shadows).
- ``random`` — uniform over the legal interventions of every group (and doing nothing).

The learned controller, ``rail``, translates rail's groups, menu and outcomes for ``controller.Session``, the seam any
trainer drives (docs/controller.md).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from controller.heuristic import actionable, asked, fits, rung_plan
from policy.records import Status
from rail import seam
from rail.budget import StepBudget
from rail.interventions import Intervention
from rail.rounds import Decision, Group, Menu, Outcome


class Controller(Protocol):
    name: str
    compose: str  # how its interventions join their groups: "mix" or "replace"

    def plan_base(self, step_budget: int, group_size: int, unit: str, tokens_per_rollout: float = 1.0) -> int:
        """How many base groups to generate this step."""

    def begin_step(self, step: int, total_steps: int, budget: StepBudget, rng: np.random.Generator) -> None:
        """Step ``step`` of ``total_steps`` begins; ``budget`` is the step's (what :class:`rail.rounds.Rounds`
        charges every generation to)."""

    def decide(self, groups: Sequence[Group], remaining: int, unit: str, menu: Menu) -> list[Decision]:
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

    def begin_step(self, step, total_steps, budget, rng) -> None:
        self.rng = rng

    def decide(self, groups, remaining, unit, menu) -> list[Decision]:
        return []

    def observe(self, outcomes) -> None:
        pass

    def reserve(self, decided: Sequence[Group], menu: Menu, rounds_left: int, refills: int = 0) -> float:
        """The most this controller can still spend in the step's ``rounds_left`` later rounds, given the groups it
        just intervened on (``decided``) and the fresh groups it just bought (``refills``). Only these can be asked
        again (the rung rule's asking rule, :func:`controller.heuristic.asked`); whatever the budget holds beyond
        it buys the fill's fresh groups now, alongside the round (:class:`rail.rounds.Rounds`)."""
        return 0.0

    def feedback(self, groups, outcomes, compose: str, absorbed=None) -> None:
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

    def begin_step(self, step, total_steps, budget, rng) -> None:
        self.rng, self.round = rng, 0

    def decide(self, groups, remaining, unit, menu) -> list[Decision]:
        out = self._decide(groups, remaining, unit, menu)
        self.round += 1
        return out

    def _decide(self, groups, remaining, unit, menu) -> list[Decision]:
        raise NotImplementedError

    #: whether a group it intervened on may be decided for again in a later round of the step
    escalates = True

    def reserve(self, decided, menu, rounds_left, refills=0) -> float:
        if not self.escalates or rounds_left <= 0:
            return 0.0
        return rounds_left * (sum(self._most(g, menu) for g in decided) + refills * menu.refill_cost)

    def _most(self, g: Group, menu: Menu) -> float:
        """The most one of its decisions on ``g`` may cost: the dearest legal intervention of the menu."""
        return max((c for c in (menu.cost(g, iv) for iv in menu.legal(g)) if c is not None), default=0.0)

    @staticmethod
    def _take(decisions: list[tuple[Decision, float | None]], remaining: float) -> list[Decision]:
        """Decisions in order while their costs fit ``remaining`` (:func:`controller.heuristic.fits`)."""
        out = []
        for d, c in decisions:
            if c is not None and fits(c, remaining):
                out.append(d)
                remaining -= c
        return out


class DapoController(_Reserving):
    """DAPO dynamic sampling under a fixed budget: replace every zero-variance group by a fresh one."""

    name = "dapo"

    def _decide(self, groups, remaining, unit, menu):
        seen = getattr(self, "_refilled", set()) if self.round else set()
        todo = [g for g in groups if g.zero_variance_base and g.index not in seen]
        self._refilled = seen | {g.index for g in todo}
        return self._take([(Decision(g.index, refill=True), menu.refill_cost) for g in todo], remaining)


class _RungRule(_Reserving):
    """A fixed controller that runs the rung rule of :mod:`controller.heuristic` (the rule the learned controller
    shadows) over each group's rungs at ``size`` rollouts: each round, every group the rule asks takes its next
    rung among those it can act on, in group order while the budget lasts (:func:`~controller.heuristic.rung_plan`)."""

    escalates = True

    def rungs(self, g: Group) -> list[str]:
        """The rungs of ``g``'s ladder, cheapest first."""
        raise NotImplementedError

    def size(self) -> int:
        raise NotImplementedError

    def _decide(self, groups, remaining, unit, menu):
        size = self.size()
        plan = rung_plan(((g.index, keys, g.interventions, g.successes > 0, rungs_of(g, menu, keys, size))
                          for g in groups if g.n_base and asked(self.round, g.interventions, g.successes > 0)
                          for keys in [self.rungs(g)]), remaining, self.escalates)
        return [Decision(gi, iv) for gi, (_, iv, _) in plan.items()]

    def reserve(self, decided, menu, rounds_left, refills=0) -> float:
        """Each group it just intervened on may climb its untried rungs, one a round."""
        if not self.escalates or rounds_left <= 0:
            return 0.0
        total = 0.0
        for g in decided:
            costs = sorted((c for k, (_, c) in rungs_of(g, menu, self.rungs(g), self.size()).items()
                            if k not in g.interventions), reverse=True)
            total += sum(costs[:rounds_left])  # the rung this round's decision took is among them: an upper bound
        return total


def rungs_of(g: Group, menu: Menu, keys: Sequence[str], size: int) -> dict[str, tuple[Intervention, float]]:
    """The rungs (``how@where`` keys) the rule can act on in ``g`` at ``size`` rollouts, each with its intervention
    and cost (:func:`controller.heuristic.actionable`: legal there, within the group's capacity)."""
    ivs = [Intervention.parse(k, size) for k in keys]
    room = None if g.capacity is None else g.capacity - g.spent
    return actionable(((iv.key, menu.cost(g, iv), iv) for iv in ivs), room)


class RtiController(_RungRule):
    """RTI: a rubric hint at the first violation for every group without a success (one round)."""

    name = "rti"
    escalates = False

    def rungs(self, g):
        return ["rubric_hint@violation"]

    def size(self):
        return self.cfg.controller.rti_how_many


class LadderController(_RungRule):
    """Minimal intervention: each round, every group still without a success climbs one rung of its cell's ladder
    (``controller.ladder_by_cell``, else ``controller.ladder``)."""

    name = "ladder"

    def rungs(self, g):
        c = self.cfg.controller
        return c.ladder_by_cell.get(f"{g.family}/{g.task.level}", c.ladder)

    def size(self):
        return self.cfg.controller.ladder_how_many


class ActGuideController(_Reserving):
    """ActGuide fallback: for groups whose every rollout scored 0, binary-search the smallest plan length with
    any success (probe rollouts), then replace the group with ``group_size`` guided rollouts at that length."""

    name = "actguide"
    compose = "replace"

    def _most(self, g, menu) -> float:
        """A probe, or the full group of guided rollouts that ends the search."""
        L = len(g.task.action_guide)
        costs = [menu.cost(g, Intervention("action_guide", "start", n, plan_len=L))
                 for n in (self.cfg.controller.probe_rollouts, self.cfg.budget.group_size)]
        return max((c for c in costs if c is not None), default=0.0)

    def begin_step(self, step, total_steps, budget, rng) -> None:
        super().begin_step(step, total_steps, budget, rng)
        self.search: dict[int, dict] = {}

    def _decide(self, groups, remaining, unit, menu):
        c = self.cfg.controller
        out: list[tuple[Decision, int | None]] = []
        for g in groups:
            if g.index not in self.search:
                if g.n_base == 0 or not all(t.reward == 0.0 for t in g.base) or g.interventions:
                    continue
                L = len(g.task.action_guide)
                self.search[g.index] = {"lo": 1, "hi": L, "probes": 0, "found": False, "done": False, "L": L}
            s = self.search[g.index]
            if s["done"]:
                continue
            if s["lo"] < s["hi"] and s["probes"] < c.max_probes:
                m = (s["lo"] + s["hi"]) // 2
                iv = Intervention("action_guide", "start", c.probe_rollouts, plan_len=m)
                out.append((Decision(g.index, iv, probe=True, info={"plan_len": m}), menu.cost(g, iv)))
            else:
                s["done"] = True
                if s["found"] or s["lo"] == s["L"]:
                    iv = Intervention("action_guide", "start", self.cfg.budget.group_size, plan_len=s["lo"])
                    out.append((Decision(g.index, iv), menu.cost(g, iv)))
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
    escalates = False

    def _decide(self, groups, remaining, unit, menu):
        if self.round:
            return []
        out = []
        for gi in self.rng.permutation(len(groups)):
            g = groups[int(gi)]
            candidates: list[Intervention | None] = [None, *menu.legal(g)]
            pick = candidates[int(self.rng.integers(len(candidates)))]
            if pick is not None:
                out.append((Decision(g.index, pick, propensity=1.0 / len(candidates)), menu.cost(g, pick)))
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
    it (docs/controller.md). rail's groups, menu and outcomes go to the trainer-agnostic
    :class:`controller.Session` through the one mapping of :mod:`rail.seam`; the session holds every rule: the
    context, the menu as bandit actions, the shadowed heuristic, escalation rounds, the reward, pass rates,
    traces and state."""

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
            compose=compose_of(config), reward=c.reward)
        trace_dir = None if out is None else Path(out) / "traces"
        self.session = Session(session, seed=config.run.seed, trace_dir=trace_dir)
        self.ctl = self.session.ctl
        if c.init_from:  # (a resumed run's checkpoint then replaces it with the state it had reached)
            from controller.traces import find_trace

            self.session.reuse(find_trace(c.init_from))
        self._views: dict[str, Group] = {}  # the session's group id -> rail's group
        self._event: dict[int, str] = {}  # id(rail Decision) -> the session's event id

    def begin_step(self, step, total_steps, budget, rng) -> None:
        super().begin_step(step, total_steps, budget, rng)
        self.session.begin_step(step, total_steps, budget.limit)
        self._views, self._event = {}, {}

    def _add(self, groups: Sequence[Group], menu: Menu | None) -> None:
        """Groups the session has not seen, as its records (:func:`rail.seam.group`)."""
        new = []
        for g in groups:
            rec = seam.group(g, menu)
            if rec.id not in self._views:
                self._views[rec.id] = g
                new.append(rec)
        self.session.add(new)

    def _decide(self, groups, remaining, unit, menu):
        if self.round == 0:
            self._add(groups, menu)
        out = []
        for d in self.session.decide(remaining):
            if d.intervenes:
                mine = Decision(self._views[d.group].index, d.intervention.ref, propensity=d.propensity,
                                info={"event": d.id, "mode": d.mode})
                self._event[id(mine)] = d.id
                out.append(mine)
        return out

    def observe(self, outcomes) -> None:
        """A round's interventions that ran: their scored rollouts reach the session (escalation reads them)."""
        for o in outcomes:
            eid = self._event.get(id(o.decision))
            if eid is not None and o.ran:
                self.session.ran(eid, [seam.rollout(t) for t in o.trajectories], o.cost)

    def feedback(self, groups, outcomes, compose: str, absorbed: Sequence[float | None] | None = None) -> None:
        """Rewards for this step's decisions, once the learner has said which rollouts it accepted (``compose``
        is the session's, resolved from the same config); ``absorbed``, one per outcome, for a "learning" reward
        (:class:`rail.learning.Absorption`)."""
        self._add(groups, None)  # fresh groups bought with what the rounds left: the opportunity, pass rates
        accepted, took = {}, {}
        for k, o in enumerate(outcomes):
            eid = self._event.get(id(o.decision))
            if eid is not None:
                accepted[eid] = [Status(t.status).joined for t in o.trajectories]
                if absorbed is not None and absorbed[k] is not None:
                    took[eid] = absorbed[k]
        self.session.end_step(accepted, took)
        self._views, self._event = {}, {}

    def metrics(self) -> dict[str, float]:
        return self.session.metrics()

    def summary(self) -> dict:
        return self.session.summary()

    def state_dict(self) -> dict:
        return self.session.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.session.load_state_dict(state)


CONTROLLERS["rail"] = RailController


def compose_of(cfg: Any) -> str:
    """How intervened rollouts join their group (``controller.compose``; ``auto``: the controller's own, ``replace``
    for actguide, ``mix`` for the others): the one resolution rail's loop, the learned controller and the adapters
    use."""
    c = cfg.controller
    return c.compose if c.compose != "auto" else CONTROLLERS[c.name].compose
