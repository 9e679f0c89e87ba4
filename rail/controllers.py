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

from controller.heuristic import asked, next_rung
from policy.records import Status
from rail.interventions import Intervention
from rail.rounds import Decision, Group, Menu, Outcome


class Controller(Protocol):
    name: str
    compose: str  # how its interventions join their groups: "mix" or "replace"

    def plan_base(self, step_budget: int, group_size: int, unit: str, tokens_per_rollout: float = 1.0) -> int:
        """How many base groups to generate this step."""

    def begin_step(self, step: int, rng: np.random.Generator) -> None: ...

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

    def begin_step(self, step, rng) -> None:
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
        todo = [g for g in groups if g.zero_variance_base and g.index not in seen]
        self._refilled = seen | {g.index for g in todo}
        return self._take([(Decision(g.index, refill=True), menu.refill_cost) for g in todo], remaining)


class _RungRule(_Reserving):
    """A fixed controller that runs the rung rule of :mod:`controller.heuristic` (the rule the learned controller
    shadows) over ``rungs`` at ``size`` rollouts: each round, every group the rule asks takes its next rung among
    those legal there and within its capacity, in group order while the budget lasts."""

    escalates = True

    def rungs(self) -> tuple[list[str], int]:
        raise NotImplementedError

    def _decide(self, groups, remaining, unit, menu):
        keys, size = self.rungs()
        out = []
        for g in groups:
            if not g.n_base or not asked(self.round, g.interventions, g.successes > 0):
                continue
            priced = actionable(g, menu, keys, size)
            key = next_rung(keys, g.interventions, priced, g.successes > 0, self.escalates)
            if key is not None:
                out.append((Decision(g.index, priced[key][0]), priced[key][1]))
        return self._take(out, remaining)


    def reserve(self, decided, menu, rounds_left, refills=0) -> float:
        """Each group it just intervened on may climb its untried rungs, one a round."""
        if not self.escalates or rounds_left <= 0:
            return 0.0
        keys, size = self.rungs()
        total = 0.0
        for g in decided:
            costs = sorted((c for k, (_, c) in actionable(g, menu, keys, size).items() if k not in g.interventions),
                           reverse=True)
            total += sum(costs[:rounds_left])  # the rung this round's decision took is among them: an upper bound
        return total


def actionable(g: Group, menu: Menu, keys: Sequence[str], size: int) -> dict[str, tuple[Intervention, float]]:
    """The rungs (``how@where`` keys) that can act on ``g`` at ``size`` rollouts: legal there, within the group's
    capacity; each with its intervention and cost."""
    out = {}
    for k in keys:
        iv = Intervention.parse(k, size)
        c = menu.cost(g, iv)
        if c is not None and (g.capacity is None or c <= g.capacity - g.spent + 1e-9):
            out[k] = (iv, c)
    return out


class RtiController(_RungRule):
    """RTI: a rubric hint at the first violation for every group without a success (one round)."""

    name = "rti"
    escalates = False

    def rungs(self):
        return ["rubric_hint@violation"], self.cfg.controller.rti_how_many


class LadderController(_RungRule):
    """Minimal intervention: each round, every group still without a success climbs one rung."""

    name = "ladder"

    def rungs(self):
        return list(self.cfg.controller.ladder), self.cfg.controller.ladder_how_many


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

    def begin_step(self, step, rng) -> None:
        super().begin_step(step, rng)
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
            options: list[Intervention | None] = [None, *menu.legal(g)]
            pick = options[int(self.rng.integers(len(options)))]
            if pick is not None:
                out.append((Decision(g.index, pick, propensity=1.0 / len(options)), menu.cost(g, pick)))
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
            compose=compose_of(config))
        trace_dir = None if out is None else Path(out) / "traces"
        self.session = Session(session, seed=config.run.seed, trace_dir=trace_dir)
        self.ctl = self.session.ctl
        self.seconds = 0.0  # the controller's own time: the session's and this translation's
        self._views: dict[str, Group] = {}
        self._event: dict[int, str] = {}  # id(rail Decision) -> the session's event id

    def begin_step(self, step, rng) -> None:
        super().begin_step(step, rng)
        self.session.begin_step(step, self.cfg.run.steps, self.cfg.step_budget())
        self._views, self._event = {}, {}

    def _add(self, groups: Sequence[Group], menu: Menu | None) -> None:
        """Groups the session has not seen, as scored records with their legal, priced options."""
        import controller as seam

        new = []
        for g in groups:
            gid = f"g{g.index}"
            if gid in self._views:
                continue
            self._views[gid] = g
            options = []
            if menu is not None and g.n_base:
                for iv in menu.legal(g):
                    c = menu.cost(g, iv)
                    options.append(seam.Option(iv.name, iv.key, iv.how_many, c, iv.features(), ref=iv))
            new.append(seam.Group(gid, g.family, g.task.level, [_record(t, menu is not None) for t in g.base],
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
                d = Decision(self._views[ch.group].index, ch.option.ref, propensity=ch.propensity,
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
                accepted[eid] = [Status(t.status).joined for t in o.trajectories]
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


def compose_of(cfg: Any) -> str:
    """How intervened rollouts join their group (``controller.compose``; ``auto``: the controller's own, ``replace``
    for actguide, ``mix`` for the others): the one resolution rail's loop, the learned controller and the adapters
    use."""
    c = cfg.controller
    return c.compose if c.compose != "auto" else CONTROLLERS[c.name].compose
