"""Rollout engines: batched multi-turn generation with tool calls executed between turns.

An engine takes :class:`~policy.records.RolloutRequest` objects and returns :class:`~policy.records.Trajectory` records,
token-in/token-out: the prompt is rendered once through the chat template, every assistant turn is sampled
token by token, and tool observations are appended as template tokens (never re-tokenising earlier text).
A request may continue a trajectory from a prefix (its first ``t`` turns, copied with their tokens and
log-probs) and may carry :class:`~policy.records.Guidance` that is marked so the learner can strip it.

Generation is turn by turn: an engine's :meth:`~RolloutEngine.stream` is a :class:`RolloutStream`, to which
requests can be added while it runs (they join the batch at its next turn), and ``generate`` is a stream that all
requests join at once, run until every episode has ended.

``TransformersEngine`` is the CPU default; ``policy.vllm_engine.VLLMEngine`` implements the same protocol on vLLM.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from policy.kvcache import (add_columns, add_rows, grouped_heads_in_place, make_roomy, merge_rows, split_rows,
                            write_rows)
from policy.records import Guidance, Origin, RolloutRequest, Trajectory  # noqa: F401 - RolloutRequest: the engine's input
from policy.sampling import sample_tokens
from policy.tokenizer import ChatRenderer


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens_per_turn: int = 16
    max_turns: int = 8


@dataclass
class EngineStats:
    generated_tokens: int = 0
    forward_calls: int = 0
    decode_rows: int = 0  # rows the decode steps ran on (a row that sat a step out is not counted)
    seconds: float = 0.0
    tool_seconds: float = 0.0


class RolloutEngine(Protocol):
    stats: EngineStats

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        params: SamplingParams,
        seed: int,
        max_new_tokens: int | None = None,
    ) -> list[Trajectory]:
        """Generate one trajectory per request; never sample more than ``max_new_tokens`` in total."""

    def stream(self, params: SamplingParams, seed: int, max_new_tokens: int | None = None) -> "RolloutStream":
        """A running batch that requests can join between turns (:class:`RolloutStream`); never more than
        ``max_new_tokens`` sampled over everything it runs."""


class RolloutState:
    """Mutable generation state of one request (shared by every engine: prompt rendering, branching from a
    prefix, guidance marking, tool observations). The engines sample its turns; ``rail.integrations.verl`` drives
    one through verl's LLM server."""

    def __init__(self, req: RolloutRequest, renderer: ChatRenderer):
        self.req = req
        task, g = req.task, req.guidance or Guidance()
        # one runner per rollout: a stateful environment's episode, replayed up to the prefix being continued
        begin = getattr(req.env, "begin", None)
        prefix_steps = req.prefix.steps[:req.prefix_turns] if req.prefix is not None else []
        self.runner = begin(task, prefix_steps) if begin is not None else req.env
        user = task.prompt if g.plan is None else f"{task.prompt} {g.plan}"
        tools = getattr(self.runner, "tools", None)
        describe = bool(getattr(self.runner, "describes_tools", False))
        train_prompt = renderer.prompt(req.system, task.prompt, tools, describe)
        hint_now = g.hint is not None and req.prefix_turns == 0
        if hint_now:
            prompt, _ = renderer.prompt_with_hint(req.system, user, g.hint, tools, describe)
        else:
            prompt = renderer.prompt(req.system, user, tools, describe)
        self.traj = Trajectory(
            task_id=task.id, family=task.family, level=task.level, group=req.group,
            prompt_ids=prompt, train_prompt_ids=train_prompt, intervention=req.intervention,
            guidance=None if g.is_empty() else g, temperature=req.temperature,
        )
        self.finished = False
        self.pending_text = ""  # the text of the turn just sampled, for the environment to execute
        self.handle: int | None = None  # its index in the stream it runs in
        if req.prefix is not None and req.prefix_turns > 0:
            self._copy_prefix(req.prefix, req.prefix_turns, renderer, None if hint_now else g.hint)

    def _copy_prefix(self, src: Trajectory, turns: int, renderer: ChatRenderer, hint: str | None) -> None:
        if turns > src.n_turns or src.steps[turns - 1].done:
            raise ValueError(f"cannot branch {src.task_id} after turn {turns}: it has {src.n_turns} open turns")
        tr = self.traj
        for tok, o, lp, t in zip(src.ids, src.origin, src.logprobs, src.turn):
            if t >= turns:
                break
            if o == Origin.GUIDANCE:
                continue
            tr.ids.append(tok), tr.origin.append(o), tr.logprobs.append(lp), tr.turn.append(t)
        tr.steps = list(src.steps[:turns])
        tr.turn_texts = list(src.turn_texts[:turns])
        tr.prefix_turns = turns
        if hint is not None:  # replace the last tool suffix by one that carries the hint message
            last = turns - 1
            while tr.turn and tr.turn[-1] == last and tr.origin[-1] == Origin.TOOL:
                tr.ids.pop(), tr.origin.pop(), tr.logprobs.pop(), tr.turn.pop()
            prev = tr.steps[-1]
            ids, a, b = renderer.tool_suffix_with_hint(prev.observation, hint, getattr(prev, "user", None))
            for i, tok in enumerate(ids):
                self.push(tok, Origin.GUIDANCE if a <= i < b else Origin.TOOL, 0.0, last)

    def push(self, tok: int, origin: Origin, lp: float, turn: int) -> None:
        tr = self.traj
        tr.ids.append(int(tok)), tr.origin.append(int(origin)), tr.logprobs.append(float(lp)), tr.turn.append(turn)

    def context(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.ids

    def inject(self, renderer: ChatRenderer, max_turns: int, tool_clock: list) -> None:
        """A guided step's reference action, written as the policy's turn and executed, before any sampling."""
        g = self.req.guidance
        if g is not None and g.inject is not None and not self.finished:
            turn = self.traj.n_turns
            for tok in [*renderer.encode_turn(g.inject), renderer.end_of_turn]:
                self.push(tok, Origin.INJECTED, 0.0, turn)
            self.end_turn(g.inject, renderer, max_turns, tool_clock)

    def end_turn(self, text: str, renderer: ChatRenderer, max_turns: int, tool_clock: list) -> None:
        """Execute the turn just written; append the observation or finish."""
        req, tr = self.req, self.traj
        t0 = time.perf_counter()
        step = self.runner.step(req.task, text)
        tool_clock[0] += time.perf_counter() - t0
        tr.steps.append(step)
        tr.turn_texts.append(text)
        turn = tr.n_turns - 1
        obs, done = step.observation, step.done
        if done:
            tr.done, self.finished = True, True
        elif tr.n_turns >= max_turns:
            tr.truncated, self.finished = True, True
        else:
            for tok in renderer.tool_suffix(obs, getattr(step, "user", None)):
                self.push(tok, Origin.TOOL, 0.0, turn)


class RolloutStream:
    """A running batch of rollouts that requests join between turns; the multi-turn loop every engine shares (only
    sampling differs between engines: :meth:`_sample_turn`).

    - :meth:`add` starts one episode per request and returns their handles, their indices in the stream (0, 1, ...
      in the order they were added); a guided step (an injected reference action) is written and executed at once.
      They join the batch at the next :meth:`advance`.
    - :meth:`advance` samples one assistant turn for every open episode, executes each turn in its environment, and
      returns ``(handle, trajectory)`` for every episode that ended (with ``n_generated`` set), each exactly once;
      between two calls the caller can score them, decide, and add more. Nothing open: ``[]``.
    - :attr:`open`: episodes added and not returned yet (an injected step can end an episode at :meth:`add`: the
      next :meth:`advance` returns it without sampling).
    - One token budget, ``max_new_tokens``, holds for everything the stream samples, over every wave of requests;
      it is never exceeded: when what is left cannot give every open episode one more token, they all end
      truncated (:attr:`tokens_left` says what is left).

    ``generate(requests)`` is :func:`run_stream`: all requests added at once, advanced until none is open. Engines
    keep :class:`EngineStats` as for ``generate`` (``seconds``: the time spent in :meth:`add` and :meth:`advance`).
    :meth:`close` (or leaving a ``with`` block) releases what the stream holds (a KV cache); open episodes are
    dropped.
    """

    def __init__(self, renderer: ChatRenderer, params: SamplingParams, max_new_tokens: int | None,
                 stats: EngineStats):
        self.renderer, self.params, self.stats = renderer, params, stats
        self._budget = [max_new_tokens if max_new_tokens is not None else float("inf")]
        self._open: dict[int, RolloutState] = {}  # handle -> episode, in handle order
        self._added = 0
        self._closed = False

    @property
    def open(self) -> int:
        """Episodes added and not yet returned by :meth:`advance`."""
        return len(self._open)

    @property
    def tokens_left(self) -> int | None:
        """What is left of the token budget (None: no budget)."""
        b = self._budget[0]
        return None if b == float("inf") else int(b)

    def add(self, requests: Sequence[RolloutRequest]) -> list[int]:
        """Start one episode per request; they join the batch at the next turn. Returns their handles."""
        self._check()
        return self.add_episodes([RolloutState(r, self.renderer) for r in requests])

    def add_episodes(self, episodes: Sequence[RolloutState]) -> list[int]:
        """:meth:`add` for episodes already built."""
        self._check()
        t0, tool_clock = time.perf_counter(), [0.0]
        for ep in episodes:  # guided steps are written before any sampling
            ep.inject(self.renderer, self.params.max_turns, tool_clock)
        handles = list(range(self._added, self._added + len(episodes)))
        self._added += len(episodes)
        for h, ep in zip(handles, episodes):
            ep.handle = h
            self._open[h] = ep
        self._joined(list(episodes))
        self.stats.seconds += time.perf_counter() - t0
        self.stats.tool_seconds += tool_clock[0]
        return handles

    def advance(self) -> list[tuple[int, Trajectory]]:
        """Sample one assistant turn for every open episode and execute it; return the episodes that ended."""
        self._check()
        t0, tool_clock = time.perf_counter(), [0.0]
        active = [e for e in self._open.values() if not e.finished]
        if active and self._budget[0] < len(active):  # not even one more token each: stop everything
            for e in active:
                e.traj.truncated, e.finished = True, True
        elif active:
            self._sample_turn(active, self._budget)
            for e in active:
                if e.traj.truncated:  # the token budget ran out mid-turn: do not execute a cut call
                    e.finished = True
                    continue
                e.end_turn(e.pending_text, self.renderer, self.params.max_turns, tool_clock)
        out = []
        for h in [h for h, e in self._open.items() if e.finished]:
            tr = self._open.pop(h).traj
            tr.n_generated = sum(1 for o, t in zip(tr.origin, tr.turn) if o == Origin.POLICY and t >= tr.prefix_turns)
            out.append((h, tr))
        self.stats.seconds += time.perf_counter() - t0
        self.stats.tool_seconds += tool_clock[0]
        return out

    def close(self) -> None:
        """Release what the stream holds; it takes no more requests (idempotent)."""
        self._closed = True
        self._open.clear()

    def __enter__(self) -> "RolloutStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("this rollout stream is closed")

    # ------------------------------------------------------------------ what an engine provides
    def _joined(self, episodes: list[RolloutState]) -> None:
        """Episodes were added (some possibly ended already, by an injected step): place them for sampling."""

    def _sample_turn(self, active: list[RolloutState], budget: list) -> None:
        """Sample one assistant turn for every episode of ``active`` (pushing its tokens and log-probs, setting
        ``pending_text``), taking what it samples off ``budget[0]`` and marking an episode ``truncated`` when the
        budget ran out mid-turn."""
        raise NotImplementedError


class _CallbackStream(RolloutStream):
    def __init__(self, renderer, params, max_new_tokens, stats, sample_turn: Callable):
        super().__init__(renderer, params, max_new_tokens, stats)
        self._sample_turn = sample_turn


def run_stream(stream: RolloutStream, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
    """``generate`` on a new stream: add every request at once, advance until none is open; the trajectories in
    request order."""
    return _run_out(stream, stream.add(requests))


def _run_out(stream: RolloutStream, handles: list[int]) -> list[Trajectory]:
    done: dict[int, Trajectory] = {}
    while stream.open:
        done.update(stream.advance())
    return [done[h] for h in handles]


def run_episodes(episodes: list[RolloutState], renderer: ChatRenderer, params: SamplingParams,
                 max_new_tokens: int | None, sample_turn, stats: EngineStats) -> list[Trajectory]:
    """The multi-turn loop every engine shares (:class:`RolloutStream`), for episodes that all start at once, with
    ``sample_turn(active, budget)`` as the stream's :meth:`~RolloutStream._sample_turn`.

    Guided steps are written first; then, while any episode is open, ``sample_turn(active, budget)`` samples one
    assistant turn for every open episode (pushing its tokens and log-probs, setting ``pending_text``, taking
    what it samples off ``budget[0]`` and marking an episode ``truncated`` when the budget ran out mid-turn), and
    each turn is executed by its environment. Never more than ``max_new_tokens`` are sampled in total.
    """
    with _CallbackStream(renderer, params, max_new_tokens, stats, sample_turn) as stream:
        return _run_out(stream, stream.add_episodes(episodes))


class _Chunk:
    """Up to ``batch_size`` episodes that share one KV cache for their whole lifetime.

    ``fed[b]`` counts the context tokens of row ``b`` already in the cache; whatever the context holds beyond
    them (the first turn's prompt, the turn's last sampled token, a tool observation) is fed at the start of the
    next turn, left-padded so every row's next token comes from the last position. Padding and the steps a row
    sits out (it ended its turn early) are masked, so the cache has holes that no row ever attends to; position
    ids are each row's own token count, so a row sees exactly its unpadded context. Rows whose episode finished
    are dropped from the cache between turns.

    Episodes added to a running stream join a chunk between turns as new rows (:meth:`join`): their cache rows are
    masked over every column already there and ``fed`` is 0; at the next turn their contexts are prefilled in a
    forward of their own into columns of the cache they are masked on
    (:meth:`TransformersEngine._prefill_joined`), and from then on they are rows like the others.

    With transformers' per-layer ``DynamicCache`` (``roomy``), the cache grows in place and a turn's last decode
    steps can run on some of the rows only (:meth:`split`, :meth:`merge`).
    """

    def __init__(self, episodes: list[RolloutState]):
        self.eps = episodes
        self.cache = None
        self.attn: torch.Tensor | None = None  # (B, cache length), 1 where the cache holds a real token
        self.fed = [0] * len(episodes)
        self.roomy = False

    def adopt(self, cache, room: int) -> None:
        """Take the cache the first forward returned (with ``room`` spare columns if it can grow in place)."""
        self.cache, self.roomy = cache, make_roomy(cache, room)

    def reserve(self, extra: int) -> None:
        if self.roomy:
            for la in self.cache.layers:
                la.reserve(extra)

    def compact(self) -> None:
        """Drop the rows whose episode finished, from the episodes and from the cache."""
        keep = [b for b, e in enumerate(self.eps) if not e.finished]
        if len(keep) == len(self.eps):
            return
        self.eps = [self.eps[b] for b in keep]
        self.fed = [self.fed[b] for b in keep]
        if self.cache is None:  # nothing fed yet (an injected step ended the episode before any sampling)
            return
        if not keep:
            self.cache, self.attn, self.roomy = None, None, False
            return
        idx = torch.tensor(keep, device=self.attn.device)
        self.cache.batch_select_indices(idx)
        self.attn = self.attn[idx]
        # columns that no remaining row attends to (the left padding of rows that are gone) are dropped too
        used = self.attn.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        layers = getattr(self.cache, "layers", None)  # transformers 5's DynamicCache; older caches keep them all
        if first > 0 and self.roomy:
            for layer in layers:
                layer.drop_leading(first)
            self.attn = self.attn[:, first:]
        elif first > 0 and layers is not None and all(getattr(la, "keys", None) is not None for la in layers):
            for layer in layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.attn = self.attn[:, first:]

    def join(self, episodes: list[RolloutState]) -> bool:
        """Take ``episodes`` as new rows (between turns), their cache rows zeros and masked over every column the
        cache holds; False, and nothing changed, where the cache cannot take rows."""
        if self.cache is not None:
            if not add_rows(self.cache, len(episodes)):
                return False
            self.attn = torch.cat([self.attn, self.attn.new_zeros((len(episodes), self.attn.shape[1]))])
        self.eps = self.eps + list(episodes)
        self.fed = self.fed + [0] * len(episodes)
        return True

    def split(self, rows: torch.Tensor, room: int) -> "_Chunk":
        """A chunk of copies of ``rows``' cache and mask, for decode steps the other rows sit out."""
        sub = _Chunk([self.eps[b] for b in rows.tolist()])
        sub.cache, sub.attn, sub.roomy = split_rows(self.cache, rows, room), self.attn[rows], True
        return sub

    def merge(self, sub: "_Chunk", rows: torch.Tensor) -> None:
        """Append the columns ``sub`` (split from ``rows``) added, masked for the other rows."""
        n = self.attn.shape[1]
        if sub.attn.shape[1] == n:
            return
        rows = rows.to(self.attn.device)
        merge_rows(self.cache, sub.cache, rows, n)
        new = self.attn.new_zeros((self.attn.shape[0], sub.attn.shape[1] - n))
        new[rows] = sub.attn[:, n:]
        self.attn = torch.cat([self.attn, new], dim=1)


#: The fewest rows a decode step runs on when it leaves out the rows that ended their turn. Below about 16 rows
#: the BLAS takes other kernels (MKL: a linear layer's rows then round differently than in a larger batch), so a
#: smaller step would not give each row bit for bit the logits the whole chunk gives it. From 16 rows on they are
#: the same to the bit with the BLAS this was measured on; another CPU's kernels may round a step of 17 rows and
#: one of 40 differently even so, and the logits then differ by a float rounding (about 1e-7; tests allow 1e-5).
MIN_STEP_ROWS = 16


class TransformersEngine:
    """Batched sampling on a ``transformers`` causal LM with a KV cache kept across turns.

    Each chunk of up to ``batch_size`` episodes keeps its cache from the first prompt token to the end of its
    episodes: a turn feeds only what is new (the tool observation and the next turn's header), so a rollout's
    context is encoded once instead of once per turn. Finished episodes leave the cache between turns.

    Within a turn, once enough rows have written their end-of-turn token, the remaining decode steps run on the
    rows still sampling (at least ``MIN_STEP_ROWS``), on a copy of their cache rows that is merged back at the end
    of the turn, and only those rows are sampled; the generator still draws for the whole chunk, so the random
    stream, and every sampled token and log-prob, is the one every row in every step would give
    (``split_steps=False`` keeps every row in every step): to the bit with the BLAS ``MIN_STEP_ROWS`` was measured
    on; where a CPU's kernels round the smaller step differently, log-probs within a float rounding, and a token
    differs only where two candidates were that close to a tie.
    """

    def __init__(self, model: torch.nn.Module, renderer: ChatRenderer, batch_size: int = 256,
                 split_steps: bool = True):
        self.model = model
        self.renderer = renderer
        self.batch_size = batch_size
        self.split_steps = split_steps
        self.stats = EngineStats()
        # transformers >= 5.2x renamed the cache argument; take whichever this version's forward accepts
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        params: SamplingParams,
        seed: int,
        max_new_tokens: int | None = None,
    ) -> list[Trajectory]:
        with self.stream(params, seed, max_new_tokens) as stream:
            return run_stream(stream, requests)

    def stream(self, params: SamplingParams, seed: int, max_new_tokens: int | None = None) -> "_TransformersStream":
        """A :class:`RolloutStream` on this engine. Requests added while it runs join a chunk that has room (fewer
        than ``batch_size`` open episodes) as new rows, so they cost no forward pass of their own; where none has
        room, they start a new chunk. One generator, seeded with ``seed``, draws for each chunk in turn, so rows
        that join change what the stream samples afterwards (for every row of their chunk, and of the chunks after
        it); a stream that all requests join at once samples exactly what ``generate`` samples."""
        return _TransformersStream(self, params, seed, max_new_tokens)

    @staticmethod
    def _cache_of(out):
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def _forward(self, ch: _Chunk, input_ids, new_attn, pos, room: int = 0) -> torch.Tensor:
        """Append ``input_ids`` (B, S) to the chunk's cache; return the last position's logits (B, V)."""
        ch.attn = new_attn if ch.attn is None else torch.cat([ch.attn, new_attn], dim=1)
        kw = {} if ch.cache is None else {self._cache_kw: ch.cache}
        out = self.model(input_ids=input_ids, attention_mask=ch.attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **kw)
        self.stats.forward_calls += 1
        if ch.cache is None:
            ch.adopt(self._cache_of(out), room)
        else:
            ch.cache = self._cache_of(out)
        return out.logits[:, -1]

    def _padded(self, seqs: list[list[int]], starts: list[int]):
        """``seqs`` left-padded into (B, S) input ids, attention mask and position ids (row ``b`` from position
        ``starts[b]``)."""
        B, S = len(seqs), max(len(p) for p in seqs)
        ids = torch.full((B, S), self.renderer.pad, dtype=torch.long)
        attn = torch.zeros((B, S), dtype=torch.long)
        pos = torch.zeros((B, S), dtype=torch.long)
        for b, (p, f) in enumerate(zip(seqs, starts)):
            n = len(p)
            ids[b, S - n:] = torch.tensor(p, dtype=torch.long)
            attn[b, S - n:] = 1
            pos[b, S - n:] = torch.arange(f, f + n)
            pos[b, : S - n] = f  # padding: masked, any position will do
        return ids, attn, pos

    def _feed_pending(self, ch: _Chunk, device, room: int) -> torch.Tensor:
        """Feed every row's context beyond ``fed`` (left-padded); return the next-token logits (B, V). The cache
        gets room for ``room`` more columns after the feed."""
        pend = [e.context()[f:] for e, f in zip(ch.eps, ch.fed)]
        ids, attn, pos = self._padded(pend, ch.fed)
        for b, p in enumerate(pend):
            ch.fed[b] += len(p)
        ch.reserve(ids.shape[1] + room)
        return self._forward(ch, ids.to(device), attn.to(device), pos.to(device), room)

    def _prefill_joined(self, ch: _Chunk, device) -> None:
        """Prefill the rows that joined the chunk since its last turn (``fed`` 0 in a cache that holds other rows):
        their context but its last token, in one forward of their own, written into the last columns of the chunk's
        cache, which those rows are masked on (on all of them: they hold nothing yet); their last token is fed with
        the turn's feed. Fed with the other rows' observations instead, their prompts would pad every other row's
        feed to a prompt's length and add as many columns to every row's cache, which the decode steps of every
        turn after would attend over. Columns are added (masked for the other rows) only where the cache holds fewer
        than a joined context."""
        rows = [b for b, f in enumerate(ch.fed) if f == 0]
        if ch.cache is None or not rows:
            return
        pend = [ch.eps[b].context()[:-1] for b in rows]
        if not any(pend):
            return
        ids, attn, pos = self._padded(pend, [0] * len(rows))
        out = self.model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                         use_cache=True, logits_to_keep=1)
        self.stats.forward_calls += 1
        S, n = ids.shape[1], ch.attn.shape[1]
        if n < S:
            add_columns(ch.cache, S - n)
            ch.attn = torch.cat([ch.attn, ch.attn.new_zeros((ch.attn.shape[0], S - n))], dim=1)
            n = S
        at = torch.tensor(rows, device=ch.attn.device)
        if not write_rows(ch.cache, self._cache_of(out), at, n - S):
            return  # the turn's feed prefills them then
        ch.attn[at, n - S:] = attn.to(ch.attn.device)
        for b, p in zip(rows, pend):
            ch.fed[b] = len(p)

    def _step_rows(self, ch: _Chunk, sub: _Chunk | None, rows: torch.Tensor | None, alive: torch.Tensor,
                   room: int):
        """The rows the next decode step runs on: all of the chunk (``sub`` None) or a split-off part of it.

        A step leaves rows out once at most half of those in the current step are needed: the rows still
        sampling, and at least one that sits out, so the step's mask has a hole as the whole chunk's has
        (transformers drops an all-ones mask and takes another attention path), filled up to MIN_STEP_ROWS.
        A narrower split merges the current one back first; the last one is merged at the end of the turn.
        """
        n_alive = int(alive.sum())
        need = max(n_alive + 1, MIN_STEP_ROWS)  # + 1: a row that sits out keeps a hole in the step's mask
        current = len(ch.eps) if sub is None else len(sub.eps)
        if not (self.split_steps and ch.roomy and 2 * need <= current):
            return sub, rows
        if sub is not None:
            ch.merge(sub, rows)
        out = (~alive).nonzero()[:, 0]
        rows = torch.cat([alive.nonzero()[:, 0], out[: need - n_alive]]).sort().values
        return ch.split(rows.to(ch.attn.device), room), rows

    def _sample_turn(self, ch: _Chunk, params: SamplingParams, gen: torch.Generator, budget: list) -> None:
        """Sample one assistant turn for each episode of the chunk, stopping at end-of-turn.

        The decode loop keeps everything in tensors (sampled tokens, log-probs, which rows were still in their
        turn) and writes each row's turn into its record once, at the end: per-row Python per decode step
        was a measurable share of a small model's step.
        """
        device = next(self.model.parameters()).device
        eps = ch.eps
        self._prefill_joined(ch, device)
        logits = self._feed_pending(ch, device, params.max_tokens_per_turn)
        B = len(eps)
        alive = torch.ones(B, dtype=torch.bool)  # rows still sampling their turn
        cut = torch.zeros(B, dtype=torch.bool)  # rows the token budget stopped mid-turn
        fed = torch.tensor(ch.fed)
        temps = None  # per-row temperatures, where some request carries its own
        if any(e.req.temperature not in (None, params.temperature) for e in eps):
            temps = torch.tensor([params.temperature if e.req.temperature is None else e.req.temperature
                                  for e in eps], dtype=torch.float32)
        toks, lps, live = [], [], []  # per decode step: (B,) tokens, log-probs, rows that sampled
        eot, pad = self.renderer.end_of_turn, self.renderer.pad
        sub, rows = None, None  # the split-off rows the decode steps run on, if any
        logit_rows = None  # the rows ``logits`` holds (None: all)
        for k in range(params.max_tokens_per_turn):
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if budget[0] < n_alive:
                cut = alive.clone()
                break
            at = alive.nonzero()[:, 0]  # only these rows are sampled; the generator draws for all B
            if logit_rows is None:
                x = logits if n_alive == B else logits[at.to(logits.device)]
            else:
                x = logits[torch.searchsorted(logit_rows, at).to(logits.device)]
            tok_at, lp_at = sample_tokens(x, params.temperature if temps is None else temps[at], params.top_p, gen,
                                          at, B)
            tok, lp = torch.full((B,), pad), torch.zeros(B)
            tok[at], lp[at] = tok_at.cpu(), lp_at.cpu()
            toks.append(tok), lps.append(lp), live.append(alive)
            budget[0] -= n_alive
            self.stats.generated_tokens += n_alive
            alive = alive & (tok != eot)
            if k == params.max_tokens_per_turn - 1 or not bool(alive.any()):
                break
            sub, rows = self._step_rows(ch, sub, rows, alive, params.max_tokens_per_turn - 1 - k)
            step_in = torch.where(alive, tok, torch.full_like(tok, pad))[:, None]  # (B, 1)
            pos = fed[:, None].clone()  # (B, 1)
            fed += alive.long()
            step_attn = alive.long()[:, None]
            if sub is None:
                logits = self._forward(ch, step_in.to(device), step_attn.to(device), pos.to(device))
            else:
                logits = self._forward(sub, step_in[rows].to(device), step_attn[rows].to(device), pos[rows].to(device))
            logit_rows = rows
            self.stats.decode_rows += B if rows is None else len(rows)
        if sub is not None:
            ch.merge(sub, rows)
        ch.fed = fed.tolist()
        T = torch.stack(toks, 1).tolist() if toks else [[] for _ in range(B)]  # (B, steps)
        P = torch.stack(lps, 1).tolist() if toks else T
        M = torch.stack(live, 1).tolist() if toks else T
        open_rows, cut_rows = alive.tolist(), cut.tolist()
        for b, e in enumerate(eps):
            tr, turn = e.traj, e.traj.n_turns
            row = [(t, p) for t, p, m in zip(T[b], P[b], M[b]) if m]
            tr.ids.extend(t for t, _ in row)
            tr.logprobs.extend(p for _, p in row)
            tr.origin.extend([int(Origin.POLICY)] * len(row))
            tr.turn.extend([turn] * len(row))
            if cut_rows[b]:
                tr.truncated = True
            if open_rows[b]:  # ran out of tokens mid-turn: close the turn with an untrained end-of-turn
                e.push(eot, Origin.TOOL, 0.0, turn)
            e.pending_text = self.renderer.decode([t for t, _ in row if t != eot])


class _TransformersStream(RolloutStream):
    """:meth:`TransformersEngine.stream`: the episodes in chunks that keep their KV cache across turns."""

    def __init__(self, engine: TransformersEngine, params: SamplingParams, seed: int, max_new_tokens: int | None):
        super().__init__(engine.renderer, params, max_new_tokens, engine.stats)
        self.engine = engine
        device = next(engine.model.parameters()).device
        self.gen = torch.Generator(device=device).manual_seed(int(seed))  # sampling draws on the logits' device
        self.chunks: list[_Chunk] = []

    def _joined(self, episodes: list[RolloutState]) -> None:
        """Fill the chunks that have room (in order), then new chunks of ``batch_size``. (Episodes an injected step
        ended take a place too, so that ``generate``'s chunks are its requests in runs of ``batch_size``; they
        leave at the next turn.)"""
        size, rest = self.engine.batch_size, list(episodes)
        for ch in self.chunks:
            if not rest:
                break
            ch.compact()
            room = size - len(ch.eps)
            if room > 0 and ch.join(rest[:room]):
                rest = rest[room:]
        self.chunks = [ch for ch in self.chunks if ch.eps]
        self.chunks += [_Chunk(rest[i:i + size]) for i in range(0, len(rest), size)]

    @torch.no_grad()
    def _sample_turn(self, active: list[RolloutState], budget: list) -> None:
        model = self.engine.model
        was_training = model.training
        model.eval()
        try:
            with grouped_heads_in_place(model):
                for ch in self.chunks:
                    ch.compact()
                    if ch.eps:
                        self.engine._sample_turn(ch, self.params, self.gen, budget)
        finally:
            model.train(was_training)
        self.chunks = [ch for ch in self.chunks if ch.eps]

    def close(self) -> None:
        super().close()
        self.chunks = []  # their KV caches
