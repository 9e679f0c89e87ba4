"""The environment protocol: tasks, tool calls, verifiers and rubrics.

An environment produces :class:`Task` objects (prompt, verifier, ordered rubric, action guide), executes
tool calls parsed from model text, and scores trajectories. Everything is deterministic given a seed, and
every environment keeps its held-out evaluation pool disjoint from its training pool.

Environments describe their tools as JSON schemas (:meth:`Environment.tools`, OpenAI function format); a
:class:`ToolRunner` parses each assistant turn in the model's tool-call format (``rollout.tool_format``,
:mod:`rail.envs.toolcalls`: the built-in ``name(arg, arg, ...)`` grammar, ``hermes`` or ``json``) into an
:class:`Action`: positional string arguments for the built-in families, named JSON values for an environment that
sets ``named_arguments`` (``bfcl``). Model output is never evaluated.

A stateless environment runs a call with ``execute(task, action)``; a stateful one (``bfcl``: file systems,
accounts, tickets) opens one episode per rollout with ``start(task)`` and runs its calls there. Either may answer
a turn with the next user message instead of a tool result (:attr:`Step.user`), for conversations of several user
turns. ``docs/environments.md`` is the protocol's manual.
"""

from __future__ import annotations

import math
import numbers
import re
import zlib
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from rail.envs.actions import MESSAGE, Action, parse_action  # noqa: F401 - parse_action: part of the protocol's API
from rail.envs.toolcalls import get_format


@dataclass(frozen=True)
class RubricItem:
    """One ordered, individually checkable milestone of a task.

    ``kind == "call"``: holds once a successful tool call equal to ``action`` was made (the environment decides
    equality, e.g. ``calc`` treats ``+`` and ``*`` as commutative). ``kind == "answer"``: holds when the final
    answer equals ``action.args[0]``. An environment may define other kinds and decide them itself
    (``rubric_achieved``; ``bfcl``'s ``"turn"``: a user turn's ground-truth state reached). ``evidence`` is what a
    hint may reveal about the milestone; a hint lists ``calls`` after it, written in the model's tool format.
    ``action`` is the step a guided-step intervention writes for it. ``guide_end`` is how many action-guide
    actions reach it (0: one per item, the item's index + 1), the length of a plan up to it.
    """

    description: str
    kind: str  # "call" | "answer" | an environment's own
    action: Action
    result: str | None = None
    evidence: str = ""
    calls: tuple[Action, ...] = ()
    guide_end: int = 0


@dataclass(frozen=True)
class Task:
    """One problem instance."""

    id: str
    family: str
    level: int
    prompt: str  # the user message
    answer: str
    rubric: tuple[RubricItem, ...]
    action_guide: tuple[Action, ...]  # reference action sequence that solves the task


@dataclass
class Step:
    """One executed assistant turn: what the model wrote, what was parsed and what the tool returned."""

    text: str
    action: Action | None
    observation: str
    ok: bool  # the tool call was well-formed and executed without error
    done: bool  # the episode ended on this turn (an answer was given)
    user: str | None = None  # the next user message: this turn ended the reply to the current one (no tool result)
    error: str | None = None  # the tool itself failed (raised, or returned no observation string): why


@dataclass(frozen=True)
class RubricStatus:
    """Which rubric items hold for a trajectory (or a prefix of one).

    ``first_violated`` is the index of the first item that does not hold (``None`` if all hold);
    ``violated_turn`` is the turn at which the trajectory should have achieved it: the turn after the last
    milestone reached before it (0 when it is the first item). It can equal ``len(steps)`` when the
    trajectory stopped before that turn.
    """

    holds: tuple[bool, ...]
    first_violated: int | None
    violated_turn: int | None
    achieved_turn: tuple[int | None, ...] = field(default=())

    @property
    def progress(self) -> float:
        """Fraction of rubric items reached in order (items before the first violation)."""
        n = len(self.holds)
        k = n if self.first_violated is None else self.first_violated
        return k / n if n else 1.0


def rubric_status(env: "Environment", task: Task, steps: Sequence[Step]) -> RubricStatus:
    """Evaluate ``task.rubric`` on ``steps`` (a whole trajectory or any prefix of one): each item's first turn
    from the environment's ``rubric_achieved(task, steps)`` if it has one (milestones that depend on the whole
    prefix, e.g. a state), else from ``item_holds`` step by step."""
    achieved_by = getattr(env, "rubric_achieved", None)
    if achieved_by is not None:
        achieved = list(achieved_by(task, steps))
        if len(achieved) != len(task.rubric):
            raise ValueError(f"{task.id}: rubric_achieved gave {len(achieved)} turns for {len(task.rubric)} items")
    else:
        achieved = []
        for item in task.rubric:
            turn = None
            for t, step in enumerate(steps):
                if env.item_holds(task, item, step):
                    turn = t
                    break
            achieved.append(turn)
    holds = tuple(t is not None for t in achieved)
    first = next((k for k, h in enumerate(holds) if not h), None)
    violated_turn = None
    if first is not None:
        before = [t for t in achieved[:first] if t is not None]
        violated_turn = min(max(before) + 1 if before else 0, len(steps))
    return RubricStatus(holds, first, violated_turn, tuple(achieved))


class Environment(Protocol):
    """What the training loop needs from an environment family (``docs/environments.md``).

    Constructed as ``Class(seed=env.seed, **env.options[<family>])``. Required: ``levels``, :meth:`system_prompt`,
    :meth:`tools`, :meth:`sample_tasks`, :meth:`eval_tasks`, :meth:`reward`, a way to run calls (:meth:`execute`,
    or :meth:`start` for a stateful environment) and a way to decide milestones (:meth:`item_holds`, or
    ``rubric_achieved(task, steps)`` for milestones that depend on the whole prefix). Optional:
    :meth:`vocabulary` (only the built-in word-level model needs it), :meth:`demonstration_task` (default: a
    training task), ``named_arguments = True`` (calls carry named JSON values, :attr:`Action.kwargs`).
    """

    name: str
    levels: tuple[int, ...]

    def system_prompt(self) -> str:
        """Instructions shown before every task: the tools and the call syntax."""

    def tools(self) -> list[dict]:
        """The tools as JSON schemas (OpenAI function format, :func:`rail.envs.toolcalls.function_schema`), their
        parameters in the order an :class:`Action` lists its arguments; ``answer`` is a tool too."""

    def vocabulary(self) -> list[str]:
        """Every word that prompts, tool calls and observations of this family can contain."""

    def sample_tasks(self, rng: np.random.Generator, levels: Sequence[int], n: int) -> list[Task]:
        """``n`` training tasks, levels drawn uniformly from ``levels``; never a held-out task."""

    def demonstration_task(self, rng: np.random.Generator, levels: Sequence[int], guided: bool) -> Task:
        """One task for a warm-start demonstration of ``levels`` (``guided``: one that follows guidance)."""

    def eval_tasks(self, level: int, n: int) -> list[Task]:
        """The first ``n`` held-out tasks of ``level`` (fewer if the pool holds fewer); the same list for the same
        environment seed."""

    def execute(self, task: Task, action: Action | None) -> tuple:
        """Run one tool call: ``(observation, ok, done)``, or ``(observation, ok, done, user)`` to go on with
        the next user message. ``action`` is ``None`` when the turn was not exactly one well-formed call."""

    def start(self, task: Task) -> "Episode":
        """A stateful environment's fresh episode of ``task`` (instead of :meth:`execute`)."""

    def reward(self, task: Task, steps: Sequence[Step]) -> float:
        """The verifier: a number in [0, 1]; 1.0 is a success."""

    def item_holds(self, task: Task, item: RubricItem, step: Step) -> bool:
        """Whether ``step`` achieves rubric ``item``."""


class Episode(Protocol):
    """One rollout's state in a stateful environment, opened by ``Environment.start(task)``. ``tools`` (optional):
    the schemas this task offers, listed in its prompt (default: the environment's)."""

    def execute(self, action: Action | None) -> tuple:
        """Run one call on this episode's state: ``(observation, ok, done)`` or ``(observation, ok, done, user)``."""


def _step(text: str, action: Action | None, run) -> Step:
    """A Step from ``run()``'s ``(observation, ok, done[, next user message])``. A tool that raises, or returns
    anything else, is a failed call with the observation ``error : tool failed`` and ``Step.error`` saying why
    (counted as ``errors/tool``); the run goes on."""
    try:
        out = run()
    except Exception as e:  # noqa: BLE001 - any tool failure is data, not a crash
        return Step(text, action, ERR_TOOL_FAILED, False, False, error=f"raised {type(e).__name__}: {e}")
    if not (isinstance(out, tuple) and len(out) in (3, 4) and isinstance(out[0], str)
            and all(isinstance(x, (bool, int)) for x in out[1:3])
            and (len(out) == 3 or out[3] is None or isinstance(out[3], str))):
        return Step(text, action, ERR_TOOL_FAILED, False, False, error=f"returned {out!r:.200}")
    obs, ok, done, *rest = out
    return Step(text=text, action=action, observation=obs, ok=bool(ok), done=bool(done),
                user=rest[0] if rest else None)


class ToolRunner:
    """Adapts an environment to the rollout engine: parse an assistant turn in the model's tool-call format, run
    the tool, return a Step. ``tools`` (the environment's schemas) is what the chat template lists in the prompt;
    :meth:`render` / :meth:`inline` write an action the way the model does (reference turns, injected steps,
    plans). :meth:`begin` opens one rollout: the runner itself for a stateless environment, an
    :class:`EpisodeRunner` over a fresh ``start(task)`` for a stateful one.

    A tool that raises, or returns anything but ``(observation string, ok, done)``, becomes a failed tool call
    with the observation ``error : tool failed`` and ``Step.error`` saying why (counted as ``errors/tool``); the
    run goes on.
    """

    def __init__(self, env: Environment, tool_format: str = "builtin"):
        self.env = env
        self.format = get_format(tool_format)
        self.tools = list(env.tools())
        self.named = bool(getattr(env, "named_arguments", False))
        # the format needs the tools' schemas in the prompt (hermes, json); the built-in one is described in the
        # environment's system prompt, in words
        self.describes_tools = self.format.name != "builtin"

    def render(self, action: Action) -> str:
        return action.render() if action.tool == MESSAGE else self.format.render(action, self.tools)

    def inline(self, action: Action) -> str:
        return action.render() if action.tool == MESSAGE else self.format.inline(action, self.tools)

    def parse(self, text: str, tools: list[dict] | None = None) -> Action | None:
        return self.format.parse(text, self.tools if tools is None else tools, self.named)

    def begin(self, task: Task, steps: Sequence[Step] = ()) -> "ToolRunner | EpisodeRunner":
        """The runner of one rollout of ``task`` that continues after ``steps`` (a copied prefix, empty for a fresh
        rollout). A stateful environment's episode replays the prefix's actions, so its state is the prefix's."""
        start = getattr(self.env, "start", None)
        if start is None:
            return self
        ep = EpisodeRunner(self, start(task))
        for st in steps:
            _step(st.text, st.action, lambda a=st.action: ep.episode.execute(a))
        return ep

    def step(self, task: Task, text: str) -> Step:
        action = self.parse(text)
        return _step(text, action, lambda: self.env.execute(task, action))


class EpisodeRunner:
    """One rollout of a stateful environment: :class:`ToolRunner`'s parsing and rendering over one
    :class:`Episode`. ``tools`` are the episode's own when it lists them (the task's tools, for the prompt)."""

    def __init__(self, runner: ToolRunner, episode: Episode):
        self.runner, self.episode = runner, episode
        self.tools = getattr(episode, "tools", None) or runner.tools
        self.render, self.inline = runner.render, runner.inline
        self.describes_tools = runner.describes_tools

    def step(self, task: Task, text: str) -> Step:
        action = self.runner.parse(text, self.tools)
        return _step(text, action, lambda: self.episode.execute(action))


def safe_reward(env: Environment, task: Task, steps: Sequence[Step]) -> tuple[float, str | None]:
    """The verifier's reward, or ``(0.0, why)`` when it raised or returned anything but a finite number in
    [0, 1]: one broken verdict costs its trajectory's reward, never the run (counted as ``errors/reward``)."""
    try:
        r = env.reward(task, steps)
    except Exception as e:  # noqa: BLE001 - a verifier bug is data about that trajectory
        return 0.0, f"raised {type(e).__name__}: {e}"
    if not isinstance(r, numbers.Real) or not math.isfinite(r) or not 0.0 <= r <= 1.0:
        return 0.0, f"returned {r!r:.200} (rewards are finite numbers in [0, 1])"
    return float(r), None


def words(text: str) -> list[str]:
    """The word-level tokenizer's view of ``text``: whitespace split, then punctuation isolated."""
    return re.findall(r"\w+|[^\w\s]", text)


def is_held_out(key: str) -> bool:
    """The held-out split: a fixed fifth of all task keys, independent of seed and sampling order."""
    return zlib.crc32(key.encode()) % 5 == 0


ERR_MALFORMED = "error : malformed call"
ERR_TOOL_FAILED = "error : tool failed"
ERR_ANSWER_ARITY = "error : answer takes one value"
ERR_TOOL = "error : unknown tool"


class ProceduralEnv:
    """What the built-in families share: the train/held-out split, task streams, levels and the verifier.

    A subclass sets ``name``, ``levels`` and ``seed`` and implements ``_draw(rng, level) -> Task``.
    """

    name: str = ""
    tool: str = ""  # the family's one tool besides ``answer``
    levels: tuple[int, ...] = ()
    seed: int = 0

    def _call(self, task: Task, action: Action) -> tuple[str, bool, bool]:
        """Run a call of ``self.tool``; arity and arguments are the subclass's to check."""
        raise NotImplementedError

    def execute(self, task: Task, action: Action | None) -> tuple[str, bool, bool]:
        """``(observation, ok, done)``. Bad calls are error observations, never exceptions."""
        if action is None:
            return ERR_MALFORMED, False, False
        if action.tool == "answer":
            if len(action.args) != 1:
                return ERR_ANSWER_ARITY, False, False
            return "", True, True
        if action.tool != self.tool:
            return ERR_TOOL, False, False
        return self._call(task, action)

    def _draw(self, rng: np.random.Generator, level: int) -> Task:
        raise NotImplementedError

    def _check_level(self, level: int) -> None:
        if level not in self.levels:
            raise ValueError(f"{self.name}: level {level} not in {self.levels}")

    def sample_tasks(self, rng: np.random.Generator, levels: Sequence[int], n: int) -> list[Task]:
        """``n`` training tasks; held-out keys are rejected and redrawn, so training never sees them."""
        levels = list(levels)
        for lv in levels:
            self._check_level(lv)
        out = []
        while len(out) < n:
            level = levels[int(rng.integers(len(levels)))]
            task = self._draw(rng, level)
            if not is_held_out(task.id):
                out.append(task)
        return out

    def demonstration_task(self, rng: np.random.Generator, levels: Sequence[int], guided: bool) -> Task:
        """One task for a warm-start demonstration (``guided``: one that follows guidance in its context).
        Default: a training task of ``levels``. A family whose guidance reveals knowledge its levels need
        (``kin``) returns a task whose knowledge does not carry over to any level instead."""
        (task,) = self.sample_tasks(rng, levels, 1)
        return task

    def eval_tasks(self, level: int, n: int) -> list[Task]:
        """The first ``n`` distinct held-out tasks of ``level`` from a fixed stream (seed, level).

        Distinct, so a small pool (level 1 holds a few hundred tasks, a fifth held out) is not padded with
        repeats; asking for more than the pool holds raises ValueError instead of looping forever.
        """
        self._check_level(level)
        rng = np.random.default_rng([self.seed, level])
        out, seen = [], set()
        for _ in range(max(100_000, 1_000 * n)):
            if len(out) >= n:
                break
            task = self._draw(rng, level)
            if is_held_out(task.id) and task.id not in seen:
                seen.add(task.id)
                out.append(task)
        if len(out) < n:
            raise ValueError(f"{self.name}: level {level} has only {len(out)} held-out tasks, asked for {n}")
        return out

    def reward(self, task: Task, steps: Sequence[Step]) -> float:
        """1.0 iff the trajectory ended with ``answer(<correct value>)``, compared as text after strip."""
        if not steps:
            return 0.0
        last = steps[-1]
        a = last.action
        ok = last.done and a is not None and a.tool == "answer" and len(a.args) == 1
        return 1.0 if ok and a.args[0].strip() == task.answer else 0.0
