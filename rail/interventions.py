"""Intervention operators: *where* to branch, *how* to help, *how many* rollouts to spend.

An :class:`Intervention` names an operator variant; :func:`plan` turns it, for one scored group, into
rollout requests and a cost known before anything runs. The operators (``docs/algorithms.md`` says where
each comes from):

- ``resample`` — branch fresh rollouts from a prefix of a failed trajectory, nothing added (tree rollouts);
- ``rubric_hint`` — at the branch point, a user message with the evidence of the first violated rubric item
  (RTI-style); the policy continues;
- ``action_guide`` — a plan in the prompt listing the first ``plan_len`` reference actions (ActGuide-style; by
  default those up to the violated item);
- ``guided_step`` — the reference action for the violated item written as the policy's own turn, executed by
  the environment; the policy continues.

Branch points (``where``): ``start`` (turn 0), ``violation`` (the turn at which the source trajectory first
violated a rubric item), ``before`` (one turn earlier) or ``entropy`` (the source's most uncertain turn: the one
whose sampled tokens have the highest mean surprisal, RAIL's high-entropy branch point; it needs no rubric).
An intervention's rollouts may be sampled at their own decoding ``temperature`` (RAIL's decoding regime; None:
the rollout temperature). The source is the group's failed trajectory with the
most rubric progress (ties: the one that violated latest, then the lowest index), so a branch keeps the most
correct work. Every intervened trajectory carries ``Trajectory.intervention``: what was done to it.

The learned controller describes interventions with :meth:`Intervention.features`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from controller import branch_source
from policy.records import Guidance, Origin, RolloutRequest, Trajectory
from rail import seam

HOWS = ("resample", "rubric_hint", "action_guide", "guided_step")
WHERES = ("start", "violation", "before", "entropy")
#: the operators that need the source's first violated rubric item (what to hint, which step to write)
NEEDS_ITEM = ("rubric_hint", "guided_step")
#: Words guidance text uses besides the environments' own; part of the policy's vocabulary.
GUIDANCE_WORDS = ("plan", ":", ";")


@dataclass(frozen=True)
class Intervention:
    """One operator variant. ``plan_len`` (``action_guide`` only): reference actions listed, 0 = up to and
    including the violated item. ``temperature``: the decoding temperature of its rollouts (None: the rollout
    temperature)."""

    how: str
    where: str
    how_many: int
    plan_len: int = 0
    temperature: float | None = None

    def __post_init__(self):
        if self.how not in HOWS:
            raise ValueError(f"unknown intervention operator {self.how!r}; one of {', '.join(HOWS)}")
        if self.where not in WHERES:
            raise ValueError(f"unknown branch point {self.where!r}; one of {', '.join(WHERES)}")
        if self.how_many < 1:
            raise ValueError(f"how_many must be >= 1, got {self.how_many}")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"an intervention's temperature must be > 0, got {self.temperature}")

    @property
    def key(self) -> str:
        """``how@where`` (``how@where:T`` at a temperature of its own): the name metrics and rungs go by."""
        return f"{self.how}@{self.where}" + ("" if self.temperature is None else f":{self.temperature:g}")

    @property
    def name(self) -> str:
        plan = f",m={self.plan_len}" if self.how == "action_guide" and self.plan_len else ""
        return f"{self.key}x{self.how_many}{plan}"

    def to_dict(self) -> dict:
        return {"how": self.how, "where": self.where, "how_many": self.how_many, "plan_len": self.plan_len,
                "temperature": self.temperature}

    @classmethod
    def parse(cls, text: str, how_many: int, temperature: float | None = None) -> "Intervention":
        """``how@where`` or ``how@where:T`` (as in config lists) -> an Intervention with ``how_many`` rollouts,
        at temperature ``T`` (else ``temperature``; None: the rollout temperature)."""
        how, _, rest = text.partition("@")
        where, colon, temp = rest.partition(":")
        if colon:
            try:
                temperature = float(temp)
            except ValueError:
                raise ValueError(f"{text!r}: the temperature after ':' must be a number, e.g. resample@entropy:1.2")
        return cls(how.strip(), (where or "violation").strip(), how_many, temperature=temperature)

    def at(self, temperature: float | None) -> "Intervention":
        """The same operator variant at another temperature."""
        return Intervention(self.how, self.where, self.how_many, self.plan_len, temperature)

    def features(self) -> dict[str, float]:
        """Action features for a contextual bandit: one-hot components, the size, and the temperature where it
        has its own."""
        f = {f"how={self.how}": 1.0, f"where={self.where}": 1.0, "how_many": float(self.how_many)}
        if self.how == "action_guide":
            f["plan_len"] = float(self.plan_len)
        if self.temperature is not None:
            f["temperature"] = float(self.temperature)
        return f


def menu_items(menu: Sequence[str], how_many: Sequence[int], temperatures: Sequence[float] = (),
               rollout_temperature: float | None = None) -> list[Intervention]:
    """The actions of a menu: each ``how@where`` entry at each size and each temperature (an entry
    ``how@where:T`` at its own only). A temperature equal to the rollout temperature is the rollout temperature
    (None), so that the plain entries the fixed controllers use are among the actions."""
    temps = list(dict.fromkeys(None if t == rollout_temperature else float(t) for t in temperatures)) or [None]
    out = []
    for m in menu:
        for k in how_many:
            iv = Intervention.parse(m, k)
            out.extend([iv] if iv.temperature is not None else [iv.at(t) for t in temps])
    return out


@dataclass
class Plan:
    """An intervention made concrete for one group: the requests to run and what they will cost."""

    group: int
    intervention: Intervention
    source: int  # index, within the group's trajectories, of the trajectory it branches from
    branch_turn: int
    item: int | None  # rubric item the help is about (the source's first violated item; None without one)
    cost: int  # in budget units; rollouts: exact; tokens: an estimate (the actual spend is charged)
    requests: list[RolloutRequest]
    probe: bool = False  # probe rollouts are charged but not trained on (ActGuide's plan-length search)


def source_index(trajs: Sequence[Trajectory]) -> int | None:
    """The failed trajectory to branch from: most rubric progress, then latest violation, then lowest index
    (``controller.branch_source``, the rule whose first violated item the controller's context reports)."""
    return branch_source([seam.rollout(t) for t in trajs])


def uncertain_turn(traj: Trajectory) -> int | None:
    """The turn whose policy-sampled tokens have the highest mean surprisal (-log-prob of the sampled token under
    the distribution it was drawn from: an unbiased estimate of that state's entropy) among the turns it executed;
    the earliest on a tie. None without a sampled token."""
    total: dict[int, float] = {}
    count: dict[int, int] = {}
    for o, lp, t in zip(traj.origin, traj.logprobs, traj.turn):
        if o == Origin.POLICY and t < traj.n_turns:
            total[t] = total.get(t, 0.0) - lp
            count[t] = count.get(t, 0) + 1
    if not total:
        return None
    return max(sorted(total), key=lambda t: total[t] / count[t])


def branch_turn(traj: Trajectory, where: str) -> int | None:
    """The number of turns to keep from ``traj`` for a branch at ``where``; None when there is no such point.

    A branch must start at a turn the trajectory reached with the episode still open.
    """
    if where == "start":
        return 0
    if where == "entropy":
        return uncertain_turn(traj)  # every turn before the last executed one left the episode open
    if traj.rubric is None:
        return None
    t = traj.rubric.violated_turn
    if t is None:
        return None
    if where == "before":
        t -= 1
        if t < 0:
            return None
    t = min(t, traj.n_turns)
    if t > 0 and traj.steps[t - 1].done:
        return None
    return t


def hint_text(task: Any, item: int, inline: Callable[[Any], str] | None = None) -> str:
    """The RTI-style hint: the evidence of rubric item ``item``, then the calls that reach it (if the item lists
    any), each written by ``inline`` (the tool runner's: the model's tool-call format)."""
    it = task.rubric[item]
    calls = getattr(it, "calls", ())
    if not calls:
        return it.evidence
    return f"{it.evidence} " + " ; ".join((inline or _render)(a) for a in calls)


def guide_end(task: Any, item: int) -> int:
    """How many action-guide actions reach rubric item ``item`` (one per item unless the item says otherwise,
    e.g. ``bfcl``'s user turns, each several calls and a reply)."""
    return getattr(task.rubric[item], "guide_end", 0) or item + 1


def guide_start(task: Any, item: int) -> int:
    """The action-guide index (the turn of a reference trajectory) at which the actions for ``item`` begin."""
    return guide_end(task, item - 1) if item > 0 else 0


def plan_text(task: Any, plan_len: int, inline: Callable[[Any], str] | None = None) -> str:
    """The ActGuide-style plan: ``plan : a1 ; a2 ; ...`` with the first ``plan_len`` reference actions, each
    written by ``inline`` (the tool runner's: the model's tool-call format; default the built-in grammar)."""
    acts = task.action_guide[:plan_len]
    return "plan : " + " ; ".join((inline or _render)(a) for a in acts)


def _render(action: Any) -> str:
    return action.render()


def _branch(iv: Intervention, tr: Trajectory) -> int | None:
    """Where ``iv`` branches ``tr``, or None when it cannot act on it."""
    t = branch_turn(tr, iv.where)
    if iv.how == "guided_step" and iv.where != "violation":
        return None  # the reference step for the violated item belongs at the violation, nowhere else
    if _item(tr) is None and (iv.how in NEEDS_ITEM or (iv.how == "action_guide" and not iv.plan_len)):
        return None  # no violated item to help with (a task without a rubric, or none violated)
    return t


def _item(tr: Trajectory) -> int | None:
    return None if tr.rubric is None else tr.rubric.first_violated


def legal(group: Sequence[Trajectory], menu: Sequence[Intervention]) -> list[Intervention]:
    """The interventions of ``menu`` that can act on this group: it has a failed trajectory to work from and
    the branch point exists there."""
    src = source_index(group)
    if src is None:
        return []
    return [iv for iv in menu if _branch(iv, group[src]) is not None]


def estimate_tokens(group: Sequence[Trajectory], task: Any, turn: int, max_tokens_per_turn: int) -> float:
    """Expected generated tokens of one rollout branched at ``turn``: the reference turns left times the
    group's mean tokens per turn (at most the per-turn cap)."""
    per_turn = [t.n_generated / max(1, t.n_turns - t.prefix_turns) for t in group if t.n_turns > t.prefix_turns]
    mean = sum(per_turn) / len(per_turn) if per_turn else float(max_tokens_per_turn)
    turns_left = max(1, len(task.action_guide) - turn)
    return min(float(max_tokens_per_turn), mean) * turns_left


def plan(intervention: Intervention, group_index: int, group: Sequence[Trajectory], task: Any, env: Any,
         system: str, unit: str, max_tokens_per_turn: int, probe: bool = False) -> Plan | None:
    """Turn ``intervention`` into requests for one group; None when it is not legal there. ``env`` is the
    group's :class:`~rail.envs.ToolRunner`: it runs the requests' tool calls and writes plans and injected
    steps in the model's tool-call format."""
    iv = intervention
    src = source_index(group)
    if src is None:
        return None
    tr = group[src]
    t = _branch(iv, tr)
    if t is None:
        return None
    item = _item(tr)
    guidance = None
    if iv.how == "rubric_hint":
        guidance = Guidance(hint=hint_text(task, item, env.inline))
    elif iv.how == "action_guide":
        m = iv.plan_len or guide_end(task, item)
        guidance = Guidance(plan=plan_text(task, min(m, len(task.action_guide)), env.inline))
    elif iv.how == "guided_step":
        guidance = Guidance(inject=env.render(task.rubric[item].action))
    record = {**iv.to_dict(), "key": iv.key, "source": src, "branch_turn": t, "item": item, "probe": probe}
    reqs = [RolloutRequest(task=task, env=env, system=system, group=group_index,
                           prefix=tr if t > 0 else None, prefix_turns=t, guidance=guidance,
                           intervention=dict(record), temperature=iv.temperature)
            for _ in range(iv.how_many)]
    if unit == "rollouts":
        cost = iv.how_many
    else:
        left = t + (1 if iv.how == "guided_step" else 0)
        cost = int(round(iv.how_many * estimate_tokens(group, task, left, max_tokens_per_turn)))
    return Plan(group_index, iv, src, t, item, max(1, cost), reqs, probe)
