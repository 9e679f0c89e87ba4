"""A training step's protocol around the controller, written once: rail's own loop (:mod:`rail.train`) and the
adapters for trainers with fixed group slots (:mod:`rail.integrations.slots`: TRL, verl) run this module and
only translate their trainer's types.

Once a step's base rollouts are scored (docs/algorithms.md, "One training step"):

1. **groups**: each task's scored rollouts are a :class:`Group`; a group whose base rollouts carry no reward spread
   is *zero-variance* (the learner's rule, :func:`policy.records.zero_variance`);
2. **the menu**: the configured interventions, legal and priced per group (:func:`make_menu`);
3. **rounds**: the controller sees every group and what is left of the step's budget and returns
   :class:`Decision` objects; a decision runs when its plan is legal and its cost fits the budget and its
   group's ``capacity``; a round's decisions run in one generation; their scored rollouts join their groups and
   reach the controller (``observe``); rounds end when the controller decides nothing, nothing ran, or after
   ``controller.max_rounds``;
4. **the fill**: what the rounds left is spent on unguided rollouts (rail: fresh groups; fixed slots: each
   group's free slots), so every controller spends the same budget;
5. once the learner's filters have set each rollout's status (:func:`policy.learner.assign_status`): the
   controller's ``feedback`` and the step's ``intervention/*`` metrics (:func:`intervention_metrics`).

Generation belongs to the caller. :meth:`Rounds.protocol` is a generator that yields :class:`Start` (begin a
:class:`Generation`: requests, and a key naming it within the step for the caller's seeds) and :class:`Wait` (send
back its scored trajectories, one per request in order). Three drivers run it: :func:`drive_stream` on an engine's
rollout stream, where what is started joins the running batch (rail's own loop); :func:`drive` with a synchronous
``generate``, which runs what was started together as one batch; :func:`adrive` with an async one (verl).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generator, Sequence

import numpy as np

from policy.records import RolloutRequest, Status, succeeded, zero_variance
from rail.budget import cost_of
from rail.envs import rubric_status, safe_reward
from rail.interventions import Intervention

#: the totals kept per intervention (how@where) over a run
STAT_KEYS = ("decisions", "rollouts", "cost", "successes", "probes", "accepted", "rejected", "rescued")


def derive_seed(*parts: int) -> int:
    """A seed derived from ``parts`` (run seed, step, call, ...): every draw of a step has its own stream, so a
    resumed run draws exactly what the uninterrupted one would have."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def score(trajs, tasks, envs, on_error=None) -> None:
    """Set each trajectory's verifier reward and rubric status; ``tasks[tr.group]`` is its (family, task). A
    verifier that raises or returns a non-finite or out-of-range value gives reward 0 and calls
    ``on_error(family, task, why)``."""
    for tr in trajs:
        fam, task = tasks[tr.group]
        env = envs[fam]
        tr.reward, why = safe_reward(env, task, tr.steps)
        if why is not None and on_error is not None:
            on_error(fam, task, why)
        tr.rubric = rubric_status(env, task, tr.steps)


def unguided_requests(tasks: Sequence, groups: Sequence[int], k: int, envs: dict, runners: dict) -> list:
    """``k`` unguided rollout requests for each group index in ``groups`` (``tasks[i]`` is its (family, task)):
    base groups, fresh groups and the fill, for rail's loop and the adapters alike."""
    return [RolloutRequest(task=tasks[i][1], env=runners[tasks[i][0]], system=envs[tasks[i][0]].system_prompt(),
                           group=i) for i in groups for _ in range(k)]


# ---------------------------------------------------------------------------------------------- the records
@dataclass
class Group:
    """One task's rollouts in a step, as a controller sees them: base rollouts first, then every intervention's."""

    index: int  # the group's index within the step (``Trajectory.group``)
    family: str
    task: Any
    trajectories: list  # policy.records.Trajectory
    n_base: int = 0
    interventions: list = field(default_factory=list)  # keys (how@where) of the interventions that ran on it
    capacity: float | None = None  # the most its interventions may cost this step (fixed slots); None: no cap
    spent: float = 0.0  # what the interventions that ran on it cost

    @property
    def base(self) -> list:
        return self.trajectories[: self.n_base]

    @property
    def zero_variance_base(self) -> bool:
        """Its base rollouts alone carry no learning signal."""
        return bool(self.n_base) and zero_variance([t.reward for t in self.base])

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories if not _is_probe(t)]

    @property
    def successes(self) -> int:
        return sum(1 for r in self.rewards if succeeded(r))


def make_group(index: int, family: str, task: Any, trajs: Sequence, capacity: float | None = None) -> Group:
    """The group of ``index`` from a generation's trajectories (those whose ``group`` is ``index``)."""
    members = [t for t in trajs if t.group == index]
    return Group(index, family, task, members, n_base=len(members), capacity=capacity)


def _is_probe(t) -> bool:
    return t.intervention is not None and bool(t.intervention.get("probe"))


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
    cost: float = 0
    trajectories: list = field(default_factory=list)

    @property
    def successes(self) -> int:
        return sum(1 for t in self.trajectories if succeeded(t.reward))


class Menu:
    """The legal interventions of a group and their costs, priced before anything runs.

    ``legal(group)`` lists the configured interventions that can act on the group; ``cost(group, iv)`` is what
    running ``iv`` would charge (None when it is not legal); ``plan_for(group, iv)`` the plan itself;
    ``refill_cost`` is a fresh base group.
    """

    def __init__(self, items: Sequence[Intervention], legal: Callable, plan_for: Callable, refill_cost: float):
        self.menu = list(items)
        self._legal, self.plan_for = legal, plan_for
        self.refill_cost = refill_cost

    def legal(self, group: Group) -> list[Intervention]:
        return self._legal(group, self.menu)

    def cost(self, group: Group, iv: Intervention) -> float | None:
        p = self.plan_for(group, iv)
        return None if p is None else p.cost


def make_menu(cfg: Any, envs: dict, runners: dict, tokens_per_rollout: float = 0.0) -> Menu:
    """The configured menu (``controller.menu`` x ``controller.how_many`` x ``controller.temperatures``) priced by :func:`rail.interventions.plan`
    for the groups of one step; plans are cached per group, intervention and group size. ``tokens_per_rollout``
    prices a fresh base group in a token budget."""
    from rail import interventions

    c, unit = cfg.controller, cfg.budget.unit
    items = interventions.menu_items(c.menu, c.how_many, c.temperatures, cfg.rollout.temperature)
    cache: dict = {}

    def plan_for(g: Group, iv: Intervention, probe: bool = False):
        key = (g.index, iv, probe, len(g.trajectories))
        if key not in cache:
            cache[key] = interventions.plan(iv, g.index, g.base, g.task, runners[g.family],
                                            envs[g.family].system_prompt(), unit, cfg.rollout.max_tokens_per_turn,
                                            probe=probe)
        return cache[key]

    def legal(g: Group, menu: Sequence[Intervention]) -> list[Intervention]:
        return interventions.legal(g.base, menu)

    refill = cfg.budget.group_size if unit == "rollouts" else int(
        cfg.budget.group_size * (tokens_per_rollout or cfg.max_rollout_tokens / 4))
    return Menu(items, legal, plan_for, refill)


# ---------------------------------------------------------------------------------------------- the rounds
@dataclass(eq=False)
class Generation:
    """What the protocol asks its caller to generate: ``requests`` (``policy.engine.RolloutRequest``), a key naming
    the call within the step (``("round", r)``, ``("refill", r)``, ``("fill",)``, ``("fill", k)``) for the caller's
    seeds, and what the budget is charged for (``"intervention"``, or ``"base"`` for refills and the fill)."""

    requests: list
    key: tuple
    kind: str


@dataclass
class Start:
    """Protocol message: begin generating ``gen``; the caller answers at once (with None), so that what it
    generates next can run alongside, e.g. in the same batch."""

    gen: Generation


@dataclass
class Wait:
    """Protocol message: answer with ``gen``'s scored trajectories, one per request in order."""

    gen: Generation


class Rounds:
    """One step's rounds and fill over ``groups`` (the scored base groups; ``tasks[i]`` is group ``i``'s (family,
    task) and grows with fresh groups).

    ``budget`` is a :class:`rail.budget.StepBudget` (every generation is charged to it by what it cost,
    :func:`rail.budget.cost_of`). ``base_requests(indices, k)`` makes ``k`` unguided requests for each group
    index. ``new_tasks(n, key)`` samples ``n`` fresh tasks (None where groups are fixed slots: refills do not run,
    and the fill goes to the groups' free slots). ``group_size`` is a fresh group's rollouts.

    The fill does not wait for the last round: as soon as a round is decided, the fresh groups that the budget
    left over by what the controller could still spend (:meth:`Controller.reserve`) pays for start alongside the
    round's interventions, so they are generated in the same batch; the rest is filled after the last round, or
    beside it when it is the last that ``max_rounds`` allows.
    """

    def __init__(self, controller, groups: list[Group], tasks: list, menu: Menu, budget, *, max_rounds: int,
                 group_size: int, base_requests: Callable[[Sequence[int], int], list],
                 new_tasks: Callable[[int, tuple], list] | None = None, tokens_per_rollout: float = 0.0):
        self.controller, self.groups, self.tasks, self.menu, self.budget = controller, groups, tasks, menu, budget
        self.max_rounds, self.g = max_rounds, group_size
        self.base_requests, self.new_tasks = base_requests, new_tasks
        self.per_rollout = max(1.0, tokens_per_rollout) if budget.unit == "tokens" else 1.0
        self.outcomes: list[Outcome] = []  # of every decision that ran
        self.trajectories: list = []  # every rollout the rounds and the fill generated
        self.controller_seconds = 0.0  # the controller's own time in the rounds (decide, reserve, observe)
        self._fills: list[tuple[Generation, int, float]] = []  # started fills: (generation, first task, cost)

    def protocol(self) -> Generator[Start | Wait, Any, list[Outcome]]:
        """The rounds, with the fill alongside as the budget allows, then the rest of the fill; returns the
        outcomes of the decisions that ran."""
        unit = self.budget.unit
        for rnd in range(self.max_rounds):
            decisions = self._timed(self.controller.decide, self.groups, self._left(), unit, self.menu)
            if not decisions:
                break
            outcomes = [Outcome(d, ran=False) for d in decisions]
            requests, owners = self._plan(outcomes, rnd)
            gens = []
            for kind in ("base", "intervention"):  # refills (fresh groups) first, then the interventions
                mine = [i for i, o in enumerate(owners) if (kind == "base") == o.decision.refill]
                if mine:
                    gen = Generation([requests[i] for i in mine], ("refill", rnd) if kind == "base" else ("round", rnd),
                                     kind)
                    gens.append((gen, mine))
                    yield Start(gen)
            if requests:  # what the controller can no longer spend buys fresh groups now, beside the round
                decided = [self.groups[o.decision.group] for o in outcomes if o.ran and not o.decision.refill]
                spare = self._left() - sum(o.cost for o in outcomes if o.ran) - self._timed(
                    self.controller.reserve, decided, self.menu, self.max_rounds - rnd - 1,
                    refills=sum(o.ran and o.decision.refill for o in outcomes))
                yield from self._start_fill(spare, final=False, last=rnd == self.max_rounds - 1)
            for gen, mine in gens:
                trajs = yield Wait(gen)
                self._charge(gen.kind, trajs)
                for i, tr in zip(mine, trajs):
                    owners[i].trajectories.append(tr)
            self._join(outcomes)
            self._timed(self.controller.observe, outcomes)
            if not requests:
                break
        yield from self._start_fill(self._left(), final=True)
        for gen, first, _ in self._fills:
            trajs = yield Wait(gen)
            self._charge("base", trajs)
            self._add_fill(trajs, first)
        self._fills = []
        return self.outcomes

    def _timed(self, call: Callable, *args, **kw):
        t0 = time.perf_counter()
        try:
            return call(*args, **kw)
        finally:
            self.controller_seconds += time.perf_counter() - t0

    def _left(self) -> float:
        """The budget left, less what started fills will cost."""
        return self.budget.remaining - sum(c for _, _, c in self._fills)

    def _plan(self, outcomes: list[Outcome], rnd: int) -> tuple[list, list[Outcome]]:
        """Price this round's decisions in order; those that fit the budget (and their group's capacity) run."""
        avail = self._left()
        free = {g.index: g.capacity - g.spent for g in self.groups if g.capacity is not None}
        requests, owners = [], []
        for o in outcomes:
            d = o.decision
            if d.refill:
                if self.new_tasks is None or self.menu.refill_cost > avail:
                    continue
                (task,) = self.new_tasks(1, (5, rnd, len(self.tasks)))
                self.tasks.append(task)
                reqs, o.cost = self.base_requests([len(self.tasks) - 1], self.g), self.menu.refill_cost
            else:
                g = self.groups[d.group]
                p = self.menu.plan_for(g, d.intervention, probe=d.probe)
                if p is None or p.cost > avail or (g.index in free and p.cost > free[g.index] + 1e-9):
                    continue
                reqs, o.cost = p.requests, p.cost
                if g.index in free:
                    free[g.index] -= p.cost
            o.ran = True
            avail -= o.cost
            requests += reqs
            owners += [o] * len(reqs)
        return requests, owners

    def _charge(self, kind: str, trajs: list) -> None:
        self.budget.charge(kind, cost_of(trajs, self.budget.unit))
        self.trajectories += trajs

    def _join(self, outcomes: list[Outcome]) -> None:
        """The round's rollouts join their groups; a refill's are a new group."""
        for o in outcomes:
            if not o.ran:
                continue
            if o.decision.refill:
                i = o.trajectories[0].group
                fam, task = self.tasks[i]
                self.groups.append(make_group(i, fam, task, o.trajectories))
            else:
                g = self.groups[o.decision.group]
                g.trajectories += o.trajectories
                g.interventions.append(o.decision.intervention.key)
                g.spent += o.cost
            self.outcomes.append(o)

    def _start_fill(self, spare: float, final: bool, last: bool = False) -> Generator[Start, Any, None]:
        """Start unguided rollouts worth at most ``spare``: fresh groups (after the last round, or beside the last
        round ``max_rounds`` allows (``last``), a smaller last group too when at least two rollouts are left, so
        they still compare), or, with fixed slots and only after the last round, each group's free slots."""
        key = ("fill",) if not self._fills else ("fill", len(self._fills))
        if self.new_tasks is None:
            if final:
                fill = [g.index for g in self.groups for _ in range(int(g.capacity or 0) - int(g.spent))]
                if fill:
                    gen = Generation(self.base_requests(fill, 1), key, "base")
                    self._fills.append((gen, -1, float(len(fill))))
                    yield Start(gen)
            return
        n_full, rest = divmod(max(0, int(spare // self.per_rollout)), self.g)
        if not (final or last) or self.budget.unit == "tokens":
            rest = 0
        if n_full == 0 and rest < 2:
            return
        first = len(self.tasks)
        self.tasks.extend(self.new_tasks(n_full + (1 if rest >= 2 else 0), (6, *key[1:])))
        reqs = self.base_requests(range(first, first + n_full), self.g)
        if rest >= 2:
            reqs += self.base_requests([len(self.tasks) - 1], rest)
        gen = Generation(reqs, key, "base")
        self._fills.append((gen, first, len(reqs) * self.per_rollout))
        yield Start(gen)

    def _add_fill(self, trajs: list, first: int) -> None:
        if first < 0:  # fixed slots: the groups' own free slots
            for g in self.groups:
                g.trajectories += [t for t in trajs if t.group == g.index]
            return
        for i in sorted({t.group for t in trajs}):
            fam, task = self.tasks[i]
            self.groups.append(make_group(i, fam, task, trajs))


def drive(protocol: Generator, generate: Callable[[Generation], list]) -> Any:
    """Run a protocol with a synchronous ``generate(generation) -> scored trajectories``: the generations started
    before a :class:`Wait` run in one call (their requests concatenated, under the first one's key), so a round's
    interventions and the fill that starts beside it are one batch. Returns the protocol's return value."""
    batch = _Batcher(generate)
    try:
        msg = next(protocol)
        while True:
            msg = protocol.send(batch.start(msg.gen) if isinstance(msg, Start) else batch.wait(msg.gen))
    except StopIteration as e:
        return e.value


async def adrive(protocol: Generator, generate: Callable[[Generation], Awaitable[list]]) -> Any:
    """:func:`drive` with an async ``generate``."""
    batch = _Batcher(generate)
    try:
        msg = next(protocol)
        while True:
            if isinstance(msg, Start):
                msg = protocol.send(batch.start(msg.gen))
            else:
                if not batch.ready(msg.gen):
                    gen = batch.merged()
                    batch.split(gen, await generate(gen))
                msg = protocol.send(batch.done.pop(msg.gen))
    except StopIteration as e:
        return e.value


def drive_stream(protocol: Generator, stream, score: Callable[[list], None]) -> Any:
    """Run a protocol on a rollout stream (``policy.engine.RolloutStream``): a started generation's requests join
    the running batch at once, and waiting for one advances the stream — every open episode, of every generation
    started — until all of that one's episodes have ended. ``score(trajectories)`` scores episodes as they end.
    A fill started beside a round goes on generating through the later rounds instead of after them."""
    owner: dict[int, tuple[Generation, int]] = {}  # stream handle -> (generation, position in it)
    results: dict[Generation, list] = {}
    try:
        msg = next(protocol)
        while True:
            if isinstance(msg, Start):
                results[msg.gen] = [None] * len(msg.gen.requests)
                for i, h in enumerate(stream.add(msg.gen.requests)):
                    owner[h] = (msg.gen, i)
                msg = protocol.send(None)
                continue
            got = results[msg.gen]
            while any(t is None for t in got):
                if not stream.open:
                    raise RuntimeError("the rollout stream ended before every episode it was given")
                ended = stream.advance()
                score([tr for _, tr in ended])
                for h, tr in ended:
                    gen, i = owner.pop(h)
                    results[gen][i] = tr
            msg = protocol.send(results.pop(msg.gen))
    except StopIteration as e:
        return e.value


class _Batcher:
    """Generations started and not yet generated, run together when one of them is waited for."""

    def __init__(self, generate):
        self.generate, self.queued, self.done = generate, [], {}

    def start(self, gen: Generation) -> None:
        self.queued.append(gen)

    def ready(self, gen: Generation) -> bool:
        return gen in self.done

    def merged(self) -> Generation:
        first = self.queued[0]
        return Generation([r for g in self.queued for r in g.requests], first.key, first.kind)

    def split(self, merged: Generation, trajs: list) -> None:
        if len(trajs) != len(merged.requests):
            raise RuntimeError(f"generate returned {len(trajs)} trajectories for {len(merged.requests)} requests")
        i = 0
        for g in self.queued:
            self.done[g] = trajs[i:i + len(g.requests)]
            i += len(g.requests)
        self.queued = []

    def wait(self, gen: Generation) -> list:
        if not self.ready(gen):
            merged = self.merged()
            self.split(merged, self.generate(merged))
        return self.done.pop(gen)


# ---------------------------------------------------------------------------------------------- after the filters
def rescued(group: Group, outcome: Outcome) -> bool:
    """Whether ``outcome`` rescued ``group``: the group's base rollouts carried no signal, and one of the
    outcome's trained rollouts broke their tie. The one definition behind the summary's rescue count and its
    per-operator column."""
    if not group.zero_variance_base:
        return False
    tie = group.base[0].reward
    return any(t.status == Status.TRAINED and abs(t.reward - tie) > 1e-3 for t in outcome.trajectories)


def intervention_metrics(groups: Sequence[Group], outcomes: Sequence[Outcome], budget_share: float,
                         per_key: dict, totals: dict) -> dict[str, float]:
    """A step's ``intervention/*`` metrics, after the learner's filters set every rollout's status: per operator
    and placement (how@where) the decisions, rollouts, successes, shift-filter acceptance and the groups it
    rescued (:func:`rescued`), and the step's totals. ``per_key`` (how@where -> ``STAT_KEYS`` totals) and
    ``totals`` (group counts) are the run's accumulators, updated in place for :func:`intervention_summary`."""
    per: dict[str, dict[str, float]] = {}
    saved: set[int] = set()  # groups rescued by at least one intervention
    for o in outcomes:
        if o.decision.refill:
            continue
        key = o.decision.intervention.key
        d = per.setdefault(key, dict.fromkeys(STAT_KEYS, 0.0))
        d["decisions"] += 1
        d["rollouts"] += len(o.trajectories)
        d["cost"] += o.cost
        d["successes"] += o.successes
        d["probes"] += len(o.trajectories) if o.decision.probe else 0
        d["rejected"] += sum(t.status == Status.SHIFT_REJECTED for t in o.trajectories)
        d["accepted"] += sum(Status(t.status).joined for t in o.trajectories)
        if rescued(groups[o.decision.group], o):
            d["rescued"] += 1
            saved.add(o.decision.group)
    intervened_zero = sum(1 for g in groups if g.interventions and g.zero_variance_base)
    for key, d in per.items():
        acc = per_key.setdefault(key, dict.fromkeys(STAT_KEYS, 0.0))
        for k, v in d.items():
            acc[k] += v
    for k, v in (("intervened_zero_variance_groups", intervened_zero), ("rescued_groups", len(saved)),
                 ("zero_variance_groups", sum(g.zero_variance_base for g in groups))):
        totals[k] = totals.get(k, 0.0) + v
    m: dict[str, float] = {}
    for key, d in per.items():
        m[f"intervention/{key}/decisions"] = d["decisions"]
        m[f"intervention/{key}/rollouts"] = d["rollouts"]
        m[f"intervention/{key}/success_rate"] = d["successes"] / d["rollouts"] if d["rollouts"] else 0.0
        measured = d["accepted"] + d["rejected"]
        m[f"intervention/{key}/accepted_share"] = d["accepted"] / measured if measured else 0.0
        m[f"intervention/{key}/rescued_groups"] = d["rescued"]
    n_roll = sum(d["rollouts"] for d in per.values())
    n_acc = sum(d["accepted"] for d in per.values())
    n_rej = sum(d["rejected"] for d in per.values())
    m.update({
        "intervention/decisions": float(sum(d["decisions"] for d in per.values())),
        "intervention/rollouts": float(n_roll),
        "intervention/success_rate": sum(d["successes"] for d in per.values()) / n_roll if n_roll else 0.0,
        "intervention/accepted_share": n_acc / (n_acc + n_rej) if n_acc + n_rej else 0.0,
        "intervention/rescued_groups": float(len(saved)),
        "intervention/rescue_rate": len(saved) / intervened_zero if intervened_zero else 0.0,
        "intervention/budget_share": budget_share,
    })
    return m


def intervention_summary(per_key: dict, totals: dict, spent_base: float, spent_intervention: float) -> dict:
    """The run's interventions for ``summary.json`` and the end-of-run table, from the accumulators that
    :func:`intervention_metrics` fills and what the run spent on base and intervention rollouts."""
    by = {k: {n: int(v) for n, v in d.items()} for k, d in sorted(per_key.items())}
    acc = sum(d["accepted"] for d in per_key.values())
    rej = sum(d["rejected"] for d in per_key.values())
    rolls = sum(d["rollouts"] for d in per_key.values())
    succ = sum(d["successes"] for d in per_key.values())
    for d in by.values():
        measured = d["accepted"] + d["rejected"]
        d["success_rate"] = round(d["successes"] / d["rollouts"], 4) if d["rollouts"] else 0.0
        d["accepted_share"] = round(d["accepted"] / measured, 4) if measured else 0.0
    total = spent_base + spent_intervention
    return {
        "budget_share": spent_intervention / total if total else 0.0,
        "rollouts": int(rolls),
        "success_rate": succ / rolls if rolls else 0.0,
        "acceptance_rate": acc / (acc + rej) if acc + rej else 0.0,
        "rescued_groups": int(totals.get("rescued_groups", 0)),
        "rescue_rate": (totals.get("rescued_groups", 0) / totals["intervened_zero_variance_groups"]
                        if totals.get("intervened_zero_variance_groups") else 0.0),
        "zero_variance_groups": int(totals.get("zero_variance_groups", 0)),
        "by_operator": by,
    }
