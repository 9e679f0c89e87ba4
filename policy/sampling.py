"""Token sampling for the rollout engines: one token per row with its behaviour log-prob.

``draw_tokens`` is ``torch.multinomial(probs, 1)`` drawn faster on CPU, with the same tokens and the same
generator state, so a seed gives the same rollouts whichever way a row is drawn.
"""

from __future__ import annotations

import math

import torch


def sample_tokens(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float, generator: torch.Generator,
    rows: torch.Tensor | None = None, batch: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens (B,), behaviour log-probs (B,)).

    The recorded log-prob is log softmax(logits / T) of the sampled token (T = 1 when greedy), i.e. the
    distribution it was drawn from; top-p only restricts which tokens can be drawn. ``temperature`` is one value,
    or one per row (a ``(B,)`` tensor of positive values: requests sampled at their own temperature). With
    ``rows``, the logits are those rows (indices) of a batch of ``batch`` rows whose other rows need no token:
    the generator draws as for the whole batch, so each row gets the token that sampling every row would give it.
    """
    logits = logits.float()  # (B, V)
    if isinstance(temperature, torch.Tensor):
        if not bool((temperature > 0).all()):
            raise ValueError("per-row temperatures must be > 0 (greedy decoding is one temperature for the batch)")
        logp = torch.log_softmax(logits / temperature.to(logits.device, torch.float32)[:, None], dim=-1)
    else:
        t = temperature if temperature > 0 else 1.0
        logp = torch.log_softmax(logits / t, dim=-1)  # (B, V)
    if not isinstance(temperature, torch.Tensor) and temperature <= 0:
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
    fast = (probs.device.type == "cpu" and generator.device.type == "cpu" and probs.dtype == torch.float32
            and probs.dim() == 2)
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
