"""The rollout -> learner contract: one flat record per trajectory, and the request an engine turns into one.

The engine fills it, the environment scores it, the learner reads only these fields. Guidance (a hint message
or a plan) is kept in the record *as sampled* and marked, so the learner can strip it from the training
context; tokens the policy did not generate (tool observations, injected steps) are never trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any


class Origin(IntEnum):
    """Where each response token came from."""

    POLICY = 0  # sampled from the policy: trained, with a behaviour log-prob
    TOOL = 1  # tool observation and chat-template glue: context only
    GUIDANCE = 2  # hint text inserted mid-trajectory: present when sampling, stripped for training
    INJECTED = 3  # an action written into the policy's turn by an intervention: context only, kept


class Status(str, Enum):
    """What the learner did with a rollout: set only by :func:`policy.learner.assign_status`, the learner's filters,
    which rail's loop and every adapter run. A ``str`` enum, so it compares equal to its value and reads as it in
    JSON."""

    UNSET = ""  # not through the filters yet
    TRAINED = "trained"  # in a group with a spread: trained with its advantage
    PROBE = "probe"  # an untrained probe (ActGuide's plan-length search): charged, never trained
    REPLACED = "replaced"  # a base rollout of a group whose intervened rollouts replace it (compose = replace)
    SHIFT_REJECTED = "shift_rejected"  # sampled under guidance the learner strips, and shifted beyond the threshold
    ZERO_VARIANCE = "zero_variance"  # its group (what is left of it) has no reward spread: no advantage
    ALL_TOOLS_FAILED = "all_tools_failed"  # every tool call it made failed (masked, TAO-RL)
    GUIDED_REPLAY = "guided_replay"  # a trained guided rollout's second copy, trained in its guided context

    @property
    def joined(self) -> bool:
        """It joined its group (the controller's reward counts it): not a probe, not rejected by the shift filter."""
        return self not in (Status.PROBE, Status.SHIFT_REJECTED)

    def __str__(self) -> str:
        return self.value


#: a group whose rewards' population standard deviation is below this carries no advantage (DAPO, TAO-RL: 1e-3)
ZERO_VARIANCE_TOL = 1e-3
#: a rollout whose reward reaches this succeeded (every environment's verifier gives 1.0 for a solved task)
SUCCESS_REWARD = 1.0


def succeeded(reward: float) -> bool:
    """Whether a rollout with this reward solved its task: the one success rule behind every success count,
    success rate and the controller's ``success`` flags."""
    return reward >= SUCCESS_REWARD


def zero_variance(rewards: list[float], tol: float = ZERO_VARIANCE_TOL) -> bool:
    """Whether a group with these rewards carries no advantage: the population standard deviation of its rewards
    is below ``tol``; an empty group carries none either. The one rule behind the learner's filter
    (:func:`policy.learner.assign_status`), a group's ``zero_variance_base`` and the rescue count."""
    if not rewards:
        return True
    m = sum(rewards) / len(rewards)
    return (sum((r - m) ** 2 for r in rewards) / len(rewards)) ** 0.5 < tol


@dataclass
class Guidance:
    """Extra context for a rollout that the learner strips before the training forward pass.

    ``plan`` is appended to the user message (ActGuide-style plan hint); ``hint`` is inserted as a user
    message at the branch point (RTI-style rubric hint); ``inject`` is an action text written as the policy's
    own turn at the branch point, executed by the environment (guided step).
    """

    plan: str | None = None
    hint: str | None = None
    inject: str | None = None

    def is_empty(self) -> bool:
        return self.plan is None and self.hint is None and self.inject is None


@dataclass
class Trajectory:
    """One multi-turn episode, token-in/token-out.

    ``prompt_ids`` is the prompt as sampled (may contain a plan); ``train_prompt_ids`` the prompt without
    guidance. ``ids``/``origin``/``logprobs``/``turn`` are aligned per response token (everything after the
    prompt). ``logprobs`` are behaviour log-probs, log softmax(logits / temperature) of the sampled token, in
    the context it was sampled in (0.0 for non-policy tokens).
    """

    task_id: str
    family: str
    level: int
    group: int  # index of the group (task) within the step
    prompt_ids: list[int]
    train_prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    steps: list[Any] = field(default_factory=list)  # rail.envs.Step per executed turn
    turn_texts: list[str] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    n_generated: int = 0  # tokens sampled in *this* rollout (a copied prefix costs nothing)
    prefix_turns: int = 0  # turns copied from the trajectory it branched from
    reward: float = 0.0
    rubric: Any = None  # rail.envs.RubricStatus
    intervention: dict | None = None  # what was done to it (None for a base rollout)
    guidance: Guidance | None = None
    temperature: float | None = None  # sampled at this temperature (None: the sampling parameters' own)
    shift: float | None = None  # shift measure (mean log-ratio guided vs stripped context), if measured
    status: Status = Status.UNSET  # what the learner did with it (policy.learner.assign_status sets it)
    keep_guidance: bool = False  # train in the context it was sampled in, guidance included (a guided replay)
    # learner.old_logprobs = "recompute": the engine's own log-probs (``logprobs`` then holds the learner's) and
    # the truncated importance-sampling weight of each response token (1.0 for non-policy tokens)
    engine_logprobs: list[float] | None = None
    is_weights: list[float] | None = None

    @property
    def n_turns(self) -> int:
        return len(self.steps)

    def tool_calls(self) -> tuple[int, int]:
        """(tool calls made, tool calls that failed), counting every turn that was not a clean answer or a clean
        end of the reply to one user message (the environment went on with the next, ``step.user``)."""
        calls = [s for s in self.steps if not ((s.done or getattr(s, "user", None) is not None) and s.ok)]
        return len(calls), sum(1 for s in calls if not s.ok)

    @property
    def context_prompt_ids(self) -> list[int]:
        """The prompt the learner trains in: without guidance, or as sampled with ``keep_guidance``."""
        return self.prompt_ids if self.keep_guidance else self.train_prompt_ids

    @property
    def context_shifted(self) -> bool:
        """Whether some of its policy tokens were sampled in a context that training strips (a plan or a hint);
        never for a guided replay, which trains in the context it was sampled in."""
        g = self.guidance
        return not self.keep_guidance and g is not None and (g.plan is not None or g.hint is not None)

    def offpolicy_flags(self) -> list[int]:
        """Aligned with :meth:`training_view`'s ids: 1 for policy tokens sampled under stripped guidance.

        Those are the tokens generated in this rollout (turn >= ``prefix_turns``) when a plan or a hint was in
        the context; a copied prefix and the continuation after an injected step are on-policy.
        """
        flags = [0] * len(self.context_prompt_ids)
        shifted = self.context_shifted
        for o, t in zip(self.origin, self.turn):
            if o == Origin.GUIDANCE and not self.keep_guidance:
                continue
            flags.append(1 if shifted and o == Origin.POLICY and t >= self.prefix_turns else 0)
        return flags

    def training_is_weights(self) -> list[float]:
        """Aligned with :meth:`training_view`'s ids: each token's importance-sampling weight (1.0 without one)."""
        out = [1.0] * len(self.context_prompt_ids)
        ws = self.is_weights if self.is_weights is not None else [1.0] * len(self.ids)
        for o, w in zip(self.origin, ws):
            if o == Origin.GUIDANCE and not self.keep_guidance:
                continue
            out.append(w if o == Origin.POLICY else 1.0)
        return out

    def training_view(self) -> tuple[list[int], list[int], list[float], list[int], list[int]]:
        """(input ids, loss mask, behaviour log-probs, turn, origin) of the sequence the learner trains on.

        The context is ``context_prompt_ids`` followed by the response with guidance tokens removed (kept, as
        untrained context, with ``keep_guidance``); only policy tokens carry a loss mask of 1.
        """
        ids = list(self.context_prompt_ids)
        n = len(ids)
        mask, lps, turns, origin = [0] * n, [0.0] * n, [-1] * n, [int(Origin.TOOL)] * n
        for tok, o, lp, t in zip(self.ids, self.origin, self.logprobs, self.turn):
            if o == Origin.GUIDANCE and not self.keep_guidance:
                continue
            ids.append(tok)
            mask.append(1 if o == Origin.POLICY else 0)
            lps.append(lp if o == Origin.POLICY else 0.0)
            turns.append(t)
            origin.append(o)
        return ids, mask, lps, turns, origin


@dataclass
class RolloutRequest:
    """One rollout to generate.

    ``env`` is anything with ``step(task, text) -> step record`` (``.observation``, ``.ok``, ``.done``, optionally
    ``.user``: the next user message, rendered in place of the tool message): it parses the assistant turn's
    text, runs the tool and never raises for bad model output. If it has ``begin(task, prefix_steps)``, each
    rollout runs on what that returns (a stateful environment's own episode, at the prefix's state). If it has
    ``tools`` (JSON schemas, OpenAI function format), the chat template lists them in the prompt.
    """

    task: Any
    env: Any
    system: str
    group: int = 0
    prefix: Trajectory | None = None
    prefix_turns: int = 0
    guidance: Guidance | None = None
    intervention: dict | None = None
    temperature: float | None = None  # sample this rollout at its own temperature (None: the sampling parameters')
