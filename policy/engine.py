"""Rollout engines: batched multi-turn generation with tool calls executed between turns.

An engine takes :class:`RolloutRequest` objects and returns :class:`~policy.records.Trajectory` records,
token-in/token-out: the prompt is rendered once through the chat template, every assistant turn is sampled
token by token, and tool observations are appended as template tokens (never re-tokenising earlier text).
A request may continue a trajectory from a prefix (its first ``t`` turns, copied with their tokens and
log-probs) and may carry :class:`~policy.records.Guidance` that is marked so the learner can strip it.

``TransformersEngine`` is the CPU default; ``policy.vllm_engine.VLLMEngine`` implements the same protocol on vLLM.
"""

from __future__ import annotations

import inspect
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
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens (B,), behaviour log-probs (B,)).

    The recorded log-prob is log softmax(logits / T) of the sampled token (T = 1 when greedy), i.e. the
    distribution the learner recomputes; top-p only restricts which tokens can be drawn.
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
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class Episode:
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
        ep.inject(renderer, params.max_turns, tool_clock)
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


class _Chunk:
    """Up to ``batch_size`` episodes that share one KV cache for their whole lifetime.

    ``fed[b]`` counts the context tokens of row ``b`` already in the cache; whatever the context holds beyond
    them (the first turn's prompt, the turn's last sampled token, a tool observation) is fed at the start of the
    next turn, left-padded so every row's next token comes from the last position. Padding and the steps a row
    sits out (it ended its turn early) are masked, so the cache has holes that no row ever attends to; position
    ids are each row's own token count, so a row sees exactly its unpadded context. Rows whose episode finished
    are dropped from the cache between turns.
    """

    def __init__(self, episodes: list[Episode]):
        self.eps = episodes
        self.cache = None
        self.attn: torch.Tensor | None = None  # (B, cache length), 1 where the cache holds a real token
        self.fed = [0] * len(episodes)

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
            self.cache, self.attn = None, None
            return
        idx = torch.tensor(keep, device=self.attn.device)
        self.cache.batch_select_indices(idx)
        self.attn = self.attn[idx]
        # columns that no remaining row attends to (the left padding of rows that are gone) are dropped too
        used = self.attn.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        layers = getattr(self.cache, "layers", None)  # transformers 5's DynamicCache; older caches keep them all
        if first > 0 and layers is not None and all(getattr(la, "keys", None) is not None for la in layers):
            for layer in layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.attn = self.attn[:, first:]


class TransformersEngine:
    """Batched sampling on a ``transformers`` causal LM with a KV cache kept across turns.

    Each chunk of up to ``batch_size`` episodes keeps its cache from the first prompt token to the end of its
    episodes: a turn feeds only what is new (the tool observation and the next turn's header), so a rollout's
    context is encoded once instead of once per turn. Finished episodes leave the cache between turns.
    """

    def __init__(self, model: torch.nn.Module, renderer: ChatRenderer, batch_size: int = 256):
        self.model = model
        self.renderer = renderer
        self.batch_size = batch_size
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
        device = next(self.model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(int(seed))  # sampling draws on the logits' device
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

    def _forward(self, ch: _Chunk, input_ids, new_attn, pos) -> torch.Tensor:
        """Append ``input_ids`` (B, S) to the chunk's cache; return the last position's logits (B, V)."""
        ch.attn = new_attn if ch.attn is None else torch.cat([ch.attn, new_attn], dim=1)
        kw = {} if ch.cache is None else {self._cache_kw: ch.cache}
        out = self.model(input_ids=input_ids, attention_mask=ch.attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **kw)
        self.stats.forward_calls += 1
        ch.cache = self._cache_of(out)
        return out.logits[:, -1]

    def _feed_pending(self, ch: _Chunk, device) -> torch.Tensor:
        """Feed every row's context beyond ``fed`` (left-padded); return the next-token logits (B, V)."""
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
        return self._forward(ch, ids.to(device), attn.to(device), pos.to(device))

    def _sample_turn(self, ch: _Chunk, params: SamplingParams, gen: torch.Generator, budget: list) -> None:
        """Sample one assistant turn for each episode of the chunk, stopping at end-of-turn.

        The decode loop keeps everything in tensors (sampled tokens, log-probs, which rows were still in their
        turn) and writes each row's turn into its record once, at the end: per-row Python per decode step
        was a measurable share of a small model's step.
        """
        device = next(self.model.parameters()).device
        eps = ch.eps
        logits = self._feed_pending(ch, device)
        B = len(eps)
        alive = torch.ones(B, dtype=torch.bool)  # rows still sampling their turn
        cut = torch.zeros(B, dtype=torch.bool)  # rows the token budget stopped mid-turn
        fed = torch.tensor(ch.fed)
        toks, lps, live = [], [], []  # per decode step: (B,) tokens, log-probs, rows that sampled
        eot, pad = self.renderer.end_of_turn, self.renderer.pad
        for k in range(params.max_tokens_per_turn):
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if budget[0] < n_alive:
                cut = alive.clone()
                break
            tok, lp = sample_tokens(logits, params.temperature, params.top_p, gen)
            tok, lp = tok.cpu(), lp.cpu()
            toks.append(tok), lps.append(lp), live.append(alive)
            budget[0] -= n_alive
            self.stats.generated_tokens += n_alive
            alive = alive & (tok != eot)
            if k == params.max_tokens_per_turn - 1 or not bool(alive.any()):
                break
            step_in = torch.where(alive, tok, torch.full_like(tok, pad))[:, None]  # (B, 1)
            pos = fed[:, None].clone()  # (B, 1)
            fed += alive.long()
            logits = self._forward(ch, step_in.to(device), alive.long()[:, None].to(device), pos.to(device))
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
