"""Rollout engines: batched multi-turn generation with tool calls executed between turns.

An engine takes :class:`RolloutRequest` objects and returns :class:`~policy.records.Trajectory` records,
token-in/token-out: the prompt is rendered once through the chat template, every assistant turn is sampled
token by token, and tool observations are appended as template tokens (never re-tokenising earlier text).
A request may continue a trajectory from a prefix (its first ``t`` turns, copied with their tokens and
log-probs) and may carry :class:`~policy.records.Guidance` that is marked so the learner can strip it.

``TransformersEngine`` is the CPU default; ``policy.vllm_engine.VLLMEngine`` implements the same protocol on vLLM.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from policy.records import Guidance, Origin, Trajectory
from policy.tokenizer import ChatRenderer


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens_per_turn: int = 16
    max_turns: int = 8


@dataclass
class RolloutRequest:
    """One rollout to generate.

    ``env`` is anything with ``step(task, text) -> step record`` (``.observation``, ``.ok``, ``.done``): it parses
    the assistant turn's text, runs the tool and never raises for bad model output. If it has ``tools`` (JSON
    schemas, OpenAI function format), the chat template lists them in the prompt.
    """

    task: Any
    env: Any
    system: str
    group: int = 0
    prefix: Trajectory | None = None
    prefix_turns: int = 0
    guidance: Guidance | None = None
    intervention: dict | None = None


@dataclass
class EngineStats:
    generated_tokens: int = 0
    forward_calls: int = 0
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


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
    rows: torch.Tensor | None = None, batch: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens (B,), behaviour log-probs (B,)).

    The recorded log-prob is log softmax(logits / T) of the sampled token (T = 1 when greedy), i.e. the
    distribution the learner recomputes; top-p only restricts which tokens can be drawn. With ``rows``, the
    logits are those rows (indices) of a batch of ``batch`` rows whose other rows need no token: the generator
    draws as for the whole batch, so each row gets the token that sampling every row would give it.
    """
    logits = logits.float()  # (B, V)
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)  # (B, V)
    if temperature <= 0:
        tok = logp.argmax(dim=-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            keep = sp.cumsum(dim=-1) - sp < top_p  # always keeps the top token
            sp = sp * keep
            probs = torch.zeros_like(probs).scatter(-1, si, sp)
        tok = draw_tokens(probs, generator, rows, batch)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


#: Ratios within this factor of a row's largest are decided on the exact noise (the approximate noise is off by
#: at most a float rounding, about 1e-7).
_NEAR = 1e-4
_fast_draw: bool | None = None  # whether this torch draws as draw_tokens expects (checked once, on first use)


def draw_tokens(probs: torch.Tensor, generator: torch.Generator, rows: torch.Tensor | None = None,
                batch: int | None = None) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator)[:, 0]``, faster on CPU: the same tokens, the same generator state
    (with ``rows``: ``probs`` holds those rows of a batch of ``batch``, drawn for as the whole batch).

    torch draws one token per row as argmax(probs / q) with q ~ Exp(1) from ``exponential_`` over the whole
    (B, V) tensor; on CPU each q is float(-log1p(-u)) with u one uniform double of the generator, computed with a
    scalar log1p that takes most of a small model's sampling time. Here u comes from ``uniform_`` (the same draws,
    in the same order), q from torch's vectorised log1p, and a row whose largest ratios lie within ``_NEAR`` of
    each other is decided on the exact q of those candidates. Whether this torch draws that way is checked once
    against torch.multinomial itself; where it does not (or on another device), torch.multinomial draws.
    """
    global _fast_draw
    fast = probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2
    if fast and _fast_draw is None:
        _fast_draw = _draws_like_torch()
    if fast and _fast_draw:
        return _draw(probs, generator, rows, batch)
    if rows is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    full = probs.new_ones((batch, probs.shape[1]))  # the other rows: any distribution will do
    full[rows.to(probs.device)] = probs
    return torch.multinomial(full, 1, generator=generator).squeeze(-1)[rows.to(probs.device)]


def _exact_noise(u: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise from uniform doubles exactly as torch's CPU ``exponential_`` makes it (scalar log1p)."""
    return torch.tensor([-math.log1p(-x) for x in u.tolist()], dtype=torch.float64).float()


def _draw(probs: torch.Tensor, generator: torch.Generator, rows: torch.Tensor | None = None,
          batch: int | None = None) -> torch.Tensor:
    if float(probs.min()) < 0:  # torch.multinomial's checks; nan, inf and all-zero rows are caught below
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    shape = probs.shape if rows is None else (batch, probs.shape[1])
    u = torch.empty(shape, dtype=torch.float64).uniform_(generator=generator)  # (batch, V)
    if rows is not None:
        u = u[rows]  # (B, V)
    ratio = probs / torch.log1p(u.neg()).neg_().float()  # (B, V)
    best, tok = ratio.max(dim=-1)
    near = ratio >= (best * (1 - _NEAR))[:, None]  # (B, V): where the exact argmax can be
    odd = ~(best > 0) | (best == math.inf)  # a nan, inf or all-zero row, or a zero draw (q = 0)
    for b in ((near.sum(-1) > 1) | odd).nonzero()[:, 0].tolist():
        if odd[b]:  # what torch.multinomial checks, here only where something is off
            p = probs[b]
            if not (float(p.min()) >= 0 and float(p.max()) < math.inf):
                raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
            if float(p.sum()) <= 0:
                raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        # a close call or a zero draw: torch's own arithmetic on the candidates (a whole row with an inf ratio),
        # argmax taking the first of equal values as torch's does
        idx = torch.arange(probs.shape[1]) if odd[b] else near[b].nonzero()[:, 0]
        tok[b] = idx[int((probs[b, idx] / _exact_noise(u[b, idx])).argmax())]
    return tok


def _draws_like_torch() -> bool:
    """Whether ``_draw`` gives torch.multinomial's tokens and generator state on this torch build."""
    g = torch.Generator().manual_seed(1234)
    a, b = torch.Generator(), torch.Generator()
    a.set_state(g.get_state()), b.set_state(g.get_state())
    q = torch.empty(8192).exponential_(generator=a)
    u = torch.empty(8192, dtype=torch.float64).uniform_(generator=b)
    if not (torch.equal(q, _exact_noise(u)) and torch.equal(a.get_state(), b.get_state())):
        return False
    probs = torch.softmax(3 * torch.randn(64, 257, generator=g), dim=-1)
    probs[::3, 1::2] = 0  # rows with zeros, as top-p leaves them
    probs[5] = probs[5, 0]  # a row of equal ratios but for the noise
    a.set_state(g.get_state()), b.set_state(g.get_state())
    want = torch.multinomial(probs, 1, generator=a).squeeze(-1)
    if not (torch.equal(_draw(probs, b), want) and torch.equal(a.get_state(), b.get_state())):
        return False
    rows = torch.arange(1, 64, 3)
    a.set_state(g.get_state()), b.set_state(g.get_state())
    want = torch.multinomial(probs, 1, generator=a).squeeze(-1)[rows]
    return torch.equal(_draw(probs[rows], b, rows, 64), want) and torch.equal(a.get_state(), b.get_state())


class Episode:
    """Mutable generation state of one request (shared by every engine: prompt rendering, branching from a
    prefix, guidance marking, tool observations)."""

    def __init__(self, req: RolloutRequest, renderer: ChatRenderer):
        self.req = req
        task, g = req.task, req.guidance or Guidance()
        user = task.prompt if g.plan is None else f"{task.prompt} {g.plan}"
        tools = getattr(req.env, "tools", None)
        train_prompt = renderer.prompt(req.system, task.prompt, tools)
        hint_now = g.hint is not None and req.prefix_turns == 0
        if hint_now:
            prompt, _ = renderer.prompt_with_hint(req.system, user, g.hint, tools)
        else:
            prompt = renderer.prompt(req.system, user, tools)
        self.traj = Trajectory(
            task_id=task.id, family=task.family, level=task.level, group=req.group,
            prompt_ids=prompt, train_prompt_ids=train_prompt, intervention=req.intervention,
            guidance=None if g.is_empty() else g,
        )
        self.finished = False
        self.pending_text = ""  # the text of the turn just sampled, for the environment to execute
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
            ids, a, b = renderer.tool_suffix_with_hint(tr.steps[-1].observation, hint)
            for i, tok in enumerate(ids):
                self.push(tok, Origin.GUIDANCE if a <= i < b else Origin.TOOL, 0.0, last)

    def push(self, tok: int, origin: Origin, lp: float, turn: int) -> None:
        tr = self.traj
        tr.ids.append(int(tok)), tr.origin.append(int(origin)), tr.logprobs.append(float(lp)), tr.turn.append(turn)

    def context(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.ids

    def end_turn(self, text: str, renderer: ChatRenderer, max_turns: int, tool_clock: list) -> None:
        """Execute the turn just written; append the observation or finish."""
        req, tr = self.req, self.traj
        t0 = time.perf_counter()
        step = req.env.step(req.task, text)
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
            for tok in renderer.tool_suffix(obs):
                self.push(tok, Origin.TOOL, 0.0, turn)


def run_episodes(episodes: list[Episode], renderer: ChatRenderer, params: SamplingParams,
                 max_new_tokens: int | None, sample_turn, stats: EngineStats) -> list[Trajectory]:
    """The multi-turn loop every engine shares; only sampling differs between engines.

    Guided steps are written first; then, while any episode is open, ``sample_turn(active, budget)`` samples one
    assistant turn for every open episode (pushing its tokens and log-probs, setting ``pending_text``, taking
    what it samples off ``budget[0]`` and marking an episode ``truncated`` when the budget ran out mid-turn), and
    each turn is executed by its environment. Never more than ``max_new_tokens`` are sampled in total.
    """
    t_start = time.perf_counter()
    budget = [max_new_tokens if max_new_tokens is not None else float("inf")]
    tool_clock = [0.0]
    for ep in episodes:  # guided steps are written before any sampling
        g = ep.req.guidance
        if g is not None and g.inject is not None and not ep.finished:
            turn = ep.traj.n_turns
            for tok in [*renderer.encode_turn(g.inject), renderer.end_of_turn]:
                ep.push(tok, Origin.INJECTED, 0.0, turn)
            ep.end_turn(g.inject, renderer, params.max_turns, tool_clock)
    while True:
        active = [e for e in episodes if not e.finished]
        if not active:
            break
        if budget[0] < len(active):  # not even one more token each: stop everything
            for e in active:
                e.traj.truncated, e.finished = True, True
            break
        sample_turn(active, budget)
        for e in active:
            if e.traj.truncated:  # the token budget ran out mid-turn: do not execute a cut call
                e.finished = True
                continue
            e.end_turn(e.pending_text, renderer, params.max_turns, tool_clock)
    for e in episodes:
        e.traj.n_generated = sum(1 for o, t in zip(e.traj.origin, e.traj.turn)
                                 if o == Origin.POLICY and t >= e.traj.prefix_turns)
    stats.seconds += time.perf_counter() - t_start
    stats.tool_seconds += tool_clock[0]
    return [e.traj for e in episodes]


#: The fewest rows a decode step runs on when it leaves the rows that ended their turn out. Below about 16 rows
#: the BLAS takes other kernels (MKL: a linear layer's rows then round differently than in a larger batch), so a
#: smaller step would not give each row bit for bit the logits the whole batch gives it.
MIN_STEP_ROWS = 16

try:  # transformers >= 4.56 keeps a DynamicCache's tensors in per-layer objects
    from transformers.cache_utils import DynamicLayer as _DynamicLayer
except ImportError:  # older caches are used as the model returns them
    _DynamicLayer = None


class _RoomyLayer(_DynamicLayer or object):
    """A ``DynamicLayer`` whose keys and values are views into zero-filled buffers with room to grow.

    ``DynamicLayer`` appends with ``torch.cat``, copying the whole cache in every layer at every decode step; here
    a step writes its column in place. The room stays zero until written, so columns added for some rows only
    (:meth:`append_rows`) hold finite values where the other rows are masked: a masked column gets weight exactly
    0, so what it holds never changes a result.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        self.is_initialized, self.device, self.dtype = True, keys.device, keys.dtype
        self._hold(keys, values, room)

    def _hold(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        B, H, n, D = keys.shape
        self._k, self._v = keys.new_empty((B, H, n + room, D)), values.new_empty((B, H, n + room, D))
        self._k[:, :, :n], self._v[:, :, :n] = keys, values
        self._k[:, :, n:], self._v[:, :, n:] = 0, 0
        self._view(n)

    def _view(self, n: int) -> None:
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]  # (B, H, n, D)

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more columns (one copy now instead of one per step), and some more: a
        turn's feed then rarely copies the cache again."""
        if self.keys.shape[-2] + extra > self._k.shape[-2]:
            self._hold(self.keys, self.values, extra + 64)

    def update(self, key_states, value_states, *args, **kwargs):
        n, s = self.keys.shape[-2], key_states.shape[-2]
        self.reserve(s)
        self._k[:, :, n:n + s], self._v[:, :, n:n + s] = key_states, value_states
        self._view(n + s)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._view(self.keys.shape[-2])

    def drop_leading(self, first: int) -> None:
        n = self.keys.shape[-2]
        self._k, self._v = self._k[:, :, first:], self._v[:, :, first:]
        self._view(n - first)

    def rows(self, rows: torch.Tensor, room: int) -> "_RoomyLayer":
        """A copy of these rows, with room for ``room`` more columns."""
        return _RoomyLayer(self.keys[rows], self.values[rows], room)

    def append_rows(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values`` (len(rows), H, k, D) as ``k`` new columns of ``rows``; the others get zeros."""
        n, k = self.keys.shape[-2], keys.shape[-2]
        self.reserve(k)
        self._k[rows, :, n:n + k], self._v[rows, :, n:n + k] = keys, values
        self._view(n + k)


class _Chunk:
    """Up to ``batch_size`` episodes that share one KV cache for their whole lifetime.

    ``fed[b]`` counts the context tokens of row ``b`` already in the cache; whatever the context holds beyond
    them (the first turn's prompt, the turn's last sampled token, a tool observation) is fed at the start of the
    next turn, left-padded so every row's next token comes from the last position. Padding and the steps a row
    sits out (it ended its turn early) are masked, so the cache has holes that no row ever attends to; position
    ids are each row's own token count, so a row sees exactly its unpadded context. Rows whose episode finished
    are dropped from the cache between turns.

    With transformers' per-layer ``DynamicCache`` (``roomy``), the cache grows in place and a turn's last decode
    steps can run on some of the rows only (:meth:`split`, :meth:`merge`).
    """

    def __init__(self, episodes: list[Episode]):
        self.eps = episodes
        self.cache = None
        self.attn: torch.Tensor | None = None  # (B, cache length), 1 where the cache holds a real token
        self.fed = [0] * len(episodes)
        self.roomy = False

    def adopt(self, cache, room: int) -> None:
        """Take the cache the first forward returned; make its layers roomy when they are plain DynamicLayers."""
        layers = getattr(cache, "layers", None)
        if _DynamicLayer is not None and layers and all(type(la) is _DynamicLayer for la in layers):
            layers[:] = [_RoomyLayer(la.keys, la.values, room) for la in layers]
            self.roomy = True
        self.cache = cache

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

    def split(self, rows: torch.Tensor, room: int) -> "_Chunk":
        """A chunk of copies of ``rows``' cache and mask, for decode steps the other rows sit out."""
        sub = _Chunk([self.eps[b] for b in rows.tolist()])
        sub.cache = copy.copy(self.cache)
        sub.cache.layers = [la.rows(rows, room) for la in self.cache.layers]
        sub.attn, sub.roomy = self.attn[rows], True
        return sub

    def merge(self, sub: "_Chunk", rows: torch.Tensor) -> None:
        """Append the columns ``sub`` (split from ``rows``) added to this cache, masked for the other rows."""
        n = self.attn.shape[1]
        k = sub.attn.shape[1] - n
        if k == 0:
            return
        for la, s in zip(self.cache.layers, sub.cache.layers):
            la.append_rows(rows, s.keys[:, :, n:], s.values[:, :, n:])
        new = self.attn.new_zeros((self.attn.shape[0], k))
        new[rows] = sub.attn[:, n:]
        self.attn = torch.cat([self.attn, new], dim=1)


class TransformersEngine:
    """Batched sampling on a ``transformers`` causal LM with a KV cache kept across turns.

    Each chunk of up to ``batch_size`` episodes keeps its cache from the first prompt token to the end of its
    episodes: a turn feeds only what is new (the tool observation and the next turn's header), so a rollout's
    context is encoded once instead of once per turn. Finished episodes leave the cache between turns.

    Within a turn, once enough rows have written their end-of-turn token, the remaining decode steps run on the
    rows still sampling (at least ``MIN_STEP_ROWS``), on a copy of their cache rows that is merged back at the end
    of the turn. Sampling still draws over the whole chunk (rows that sit out keep their last logits): the
    random stream, and so every sampled token, is the same as if every row took every step.
    ``split_steps=False`` keeps every row in every step.
    """

    def __init__(self, model: torch.nn.Module, renderer: ChatRenderer, batch_size: int = 256,
                 split_steps: bool = True):
        self.model = model
        self.renderer = renderer
        self.batch_size = batch_size
        self.split_steps = split_steps
        self.split_share = 0.5
        self.stats = EngineStats()
        # transformers >= 5.2x renamed the cache argument; take whichever this version's forward accepts
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[RolloutRequest],
        params: SamplingParams,
        seed: int,
        max_new_tokens: int | None = None,
    ) -> list[Trajectory]:
        gen = torch.Generator().manual_seed(int(seed))
        episodes = [Episode(r, self.renderer) for r in requests]
        chunks = [_Chunk(episodes[i : i + self.batch_size]) for i in range(0, len(episodes), self.batch_size)]

        def sample_turn(active: list[Episode], budget: list) -> None:
            for ch in chunks:
                ch.compact()
                if ch.eps:
                    self._sample_turn(ch, params, gen, budget)

        was_training = self.model.training
        self.model.eval()
        try:
            return run_episodes(episodes, self.renderer, params, max_new_tokens, sample_turn, self.stats)
        finally:
            self.model.train(was_training)

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

    def _feed_pending(self, ch: _Chunk, device, room: int) -> torch.Tensor:
        """Feed every row's context beyond ``fed`` (left-padded); return the next-token logits (B, V). The cache
        gets room for ``room`` more columns after the feed."""
        pend = [e.context()[f:] for e, f in zip(ch.eps, ch.fed)]
        B, S = len(pend), max(len(p) for p in pend)
        ids = torch.full((B, S), self.renderer.pad, dtype=torch.long)
        attn = torch.zeros((B, S), dtype=torch.long)
        pos = torch.zeros((B, S), dtype=torch.long)
        for b, p in enumerate(pend):
            n = len(p)
            ids[b, S - n:] = torch.tensor(p)
            attn[b, S - n:] = 1
            pos[b, S - n:] = torch.arange(ch.fed[b], ch.fed[b] + n)
            pos[b, : S - n] = ch.fed[b]  # padding: masked, any position will do
            ch.fed[b] += n
        ch.reserve(S + room)
        return self._forward(ch, ids.to(device), attn.to(device), pos.to(device), room)

    def _step_rows(self, ch: _Chunk, sub: _Chunk | None, rows: torch.Tensor | None, alive: torch.Tensor,
                   room: int):
        """The rows the next decode step runs on: all of the chunk (``sub`` None) or a split-off part of it.

        A step leaves rows out once at most half of those in the current step are needed: the rows still
        sampling, and at least one that sits out, so the step's mask has a hole as the whole batch's would
        (transformers drops an all-ones mask and takes another attention path), filled up to MIN_STEP_ROWS.
        """
        n_alive = int(alive.sum())
        need = max(n_alive + 1, MIN_STEP_ROWS)
        current = len(ch.eps) if sub is None else len(sub.eps)
        if not (self.split_steps and ch.roomy and need <= self.split_share * current):
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
        logits = self._feed_pending(ch, device, params.max_tokens_per_turn)
        B = len(eps)
        alive = torch.ones(B, dtype=torch.bool)  # rows still sampling their turn
        cut = torch.zeros(B, dtype=torch.bool)  # rows the token budget stopped mid-turn
        fed = torch.tensor(ch.fed)
        toks, lps, live = [], [], []  # per decode step: (B,) tokens, log-probs, rows that sampled
        eot, pad = self.renderer.end_of_turn, self.renderer.pad
        sub, rows = None, None  # the split-off rows the decode steps run on, if any
        logit_rows = None
        for k in range(params.max_tokens_per_turn):
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if budget[0] < n_alive:
                cut = alive.clone()
                break
            # only the rows still in their turn are sampled; the generator draws for the whole chunk
            at = alive.nonzero()[:, 0]
            if logit_rows is None:
                x = logits if n_alive == B else logits[at.to(logits.device)]
            else:
                x = logits[torch.searchsorted(logit_rows, at).to(logits.device)]
            tok_at, lp_at = sample_tokens(x, params.temperature, params.top_p, gen, at, B)
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
            logit_rows = rows  # the rows ``logits`` holds (None: all)
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
