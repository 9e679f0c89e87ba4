"""Rollout engines: batched multi-turn generation with tool calls executed between turns.

An engine takes :class:`RolloutRequest` objects and returns :class:`~policy.records.Trajectory` records,
token-in/token-out: the prompt is rendered once through the chat template, every assistant turn is sampled
token by token, and tool observations are appended as template tokens (never re-tokenising earlier text).
A request may continue a trajectory from a prefix (its first ``t`` turns, copied with their tokens and
log-probs) and may carry :class:`~policy.records.Guidance` that is marked so the learner can strip it.

``TransformersEngine`` is the CPU/GPU default; a vLLM engine implements the same ``RolloutEngine`` protocol.
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

    ``env`` is anything with ``step(task, text) -> step record`` (``.observation``, ``.ok``, ``.done``): it parses
    the assistant turn's text, runs the tool and never raises for bad model output.
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


class _Episode:
    """Mutable generation state of one request."""

    def __init__(self, req: RolloutRequest, renderer: ChatRenderer):
        self.req = req
        task, g = req.task, req.guidance or Guidance()
        user = task.prompt if g.plan is None else f"{task.prompt} {g.plan}"
        train_prompt = renderer.prompt(req.system, task.prompt)
        hint_now = g.hint is not None and req.prefix_turns == 0
        if hint_now:
            prompt, _ = renderer.prompt_with_hint(req.system, user, g.hint)
        else:
            prompt = renderer.prompt(req.system, user)
        self.traj = Trajectory(
            task_id=task.id, family=task.family, level=task.level, group=req.group,
            prompt_ids=prompt, train_prompt_ids=train_prompt, intervention=req.intervention,
            guidance=None if g.is_empty() else g,
        )
        self.finished = False
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
                self._push(tok, Origin.GUIDANCE if a <= i < b else Origin.TOOL, 0.0, last)

    def _push(self, tok: int, origin: Origin, lp: float, turn: int) -> None:
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
                self._push(tok, Origin.TOOL, 0.0, turn)


class TransformersEngine:
    """Batched sampling with a KV cache on a ``transformers`` causal LM (left-padded, one turn at a time)."""

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
        t_start = time.perf_counter()
        gen = torch.Generator().manual_seed(int(seed))
        episodes = [_Episode(r, self.renderer) for r in requests]
        budget = [max_new_tokens if max_new_tokens is not None else float("inf")]
        tool_clock = [0.0]
        was_training = self.model.training
        self.model.eval()
        try:
            for ep in episodes:  # guided steps are written before any sampling
                g = ep.req.guidance
                if g is not None and g.inject is not None and not ep.finished:
                    turn = ep.traj.n_turns
                    for tok in [*self.renderer.encode_turn(g.inject), self.renderer.end_of_turn]:
                        ep._push(tok, Origin.INJECTED, 0.0, turn)
                    ep.end_turn(g.inject, self.renderer, params.max_turns, tool_clock)
            while True:
                active = [e for e in episodes if not e.finished]
                if not active:
                    break
                if budget[0] < len(active):  # not even one more token each: stop everything
                    for e in active:
                        e.traj.truncated, e.finished = True, True
                    break
                for i in range(0, len(active), self.batch_size):
                    self._sample_turn(active[i : i + self.batch_size], params, gen, budget)
                for e in active:
                    if e.traj.truncated:  # the token budget ran out mid-turn: do not execute a cut call
                        e.finished = True
                        continue
                    e.end_turn(e._pending_text, self.renderer, params.max_turns, tool_clock)
        finally:
            self.model.train(was_training)
        out = [e.traj for e in episodes]
        for e in episodes:
            e.traj.n_generated = sum(1 for o, t in zip(e.traj.origin, e.traj.turn)
                                     if o == Origin.POLICY and t >= e.traj.prefix_turns)
        self.stats.seconds += time.perf_counter() - t_start
        self.stats.tool_seconds += tool_clock[0]
        return out

    @staticmethod
    def _cache_of(out):
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def _sample_turn(self, eps: list[_Episode], params: SamplingParams, gen: torch.Generator, budget: list) -> None:
        """Sample one assistant turn for each episode in ``eps`` (a batch), stopping at end-of-turn."""
        device = next(self.model.parameters()).device
        ctx = [e.context() for e in eps]
        B, L = len(ctx), max(len(c) for c in ctx)
        pad = self.renderer.pad
        input_ids = torch.full((B, L), pad, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for b, c in enumerate(ctx):  # left padding, so every row's next token is at position L
            input_ids[b, L - len(c):] = torch.tensor(c)
            attn[b, L - len(c):] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        input_ids, attn, pos = input_ids.to(device), attn.to(device), pos.to(device)
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        self.stats.forward_calls += 1
        past, logits = self._cache_of(out), out.logits[:, -1]
        next_pos = pos[:, -1:] + 1
        alive = torch.ones(B, dtype=torch.bool)
        texts: list[list[int]] = [[] for _ in range(B)]
        eot = self.renderer.end_of_turn
        for k in range(params.max_tokens_per_turn):
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if budget[0] < n_alive:
                for b in range(B):
                    if alive[b]:
                        eps[b].traj.truncated = True
                break
            tok, lp = sample_tokens(logits, params.temperature, params.top_p, gen)
            tok, lp = tok.cpu(), lp.cpu()
            for b in range(B):
                if not alive[b]:
                    continue
                eps[b]._push(int(tok[b]), Origin.POLICY, float(lp[b]), eps[b].traj.n_turns)
                budget[0] -= 1
                self.stats.generated_tokens += 1
                if int(tok[b]) == eot:
                    alive[b] = False
                else:
                    texts[b].append(int(tok[b]))
            if k == params.max_tokens_per_turn - 1 or not bool(alive.any()):
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
            step_in = torch.where(alive, tok, torch.full_like(tok, pad))[:, None].to(device)
            out = self.model(input_ids=step_in, attention_mask=attn, position_ids=next_pos,
                             use_cache=True, **{self._cache_kw: past})
            self.stats.forward_calls += 1
            past, logits = self._cache_of(out), out.logits[:, -1]
            next_pos = next_pos + 1
        for b, e in enumerate(eps):
            if alive[b]:  # ran out of tokens mid-turn: close the turn with an untrained end-of-turn
                e._push(eot, Origin.TOOL, 0.0, e.traj.n_turns)
            e._pending_text = self.renderer.decode(texts[b])
