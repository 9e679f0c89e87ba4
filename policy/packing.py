"""Packed forward passes: several sequences share one row, so padding is not computed.

Training batches mix short and long trajectories (a level-1 lookup is a third of a level-4 calc), and a
right-padded batch spends a large share of its forward and backward pass on padding (about 40 % in the
warm start's batches). Here the sequences of a batch are packed first-fit-decreasing into rows as long as
the longest one, each with position ids restarting at 0; with no 2D attention mask, ``transformers``
(>= 4.5x) reads the restarts as sequence boundaries and builds a block-diagonal causal mask, so no token
attends across sequences. The logits are gathered back into the right-padded layout the callers use.

Whether the installed ``transformers`` and the model's attention do this is checked once per model by
comparing a packed pass with separate ones; where it does not, :func:`forward_logits` is the plain padded
forward pass. Positions the attention mask marks as padding get some real token's logits: callers mask them.

Rows longer than :data:`PACK_MAX_TOKENS` are not packed: a block-diagonal mask is a (rows, 1, L, L) tensor and
sends attention down its quadratic-memory path, which for a batch of BFCL-length sequences (4-7k tokens) took
more than 16 GB. The padded pass takes no attention mask at all: in a right-padded batch causal attention never
reaches the padding after a sequence, so every real token sees exactly its own prefix, and attention can use its
memory-efficient kernels.
"""

from __future__ import annotations

import torch

_ATOL = 1e-4
#: Longest row a batch is packed into; longer batches take the unmasked padded pass.
PACK_MAX_TOKENS = 2048


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: the sequence indices of each row; no row's lengths sum above ``capacity``."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit rows of {capacity}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def _packed(ids: torch.Tensor, lengths: list[int], pad_id: int):
    """(row ids (R, C), row position ids (R, C), flat index (B, L) into the rows' R*C positions)."""
    B, L = ids.shape
    rows = pack_rows(lengths, L)
    R = len(rows)
    packed = torch.full((R, L), pad_id, dtype=torch.long, device=ids.device)
    pos = torch.zeros((R, L), dtype=torch.long, device=ids.device)
    index = torch.zeros((B, L), dtype=torch.long, device=ids.device)
    ar = torch.arange(L, device=ids.device)
    for r, members in enumerate(rows):
        at = 0
        for b in members:
            n = lengths[b]
            packed[r, at : at + n] = ids[b, :n]
            pos[r, at : at + n] = ar[:n]
            index[b, :n] = r * L + at + ar[:n]
            at += n
        if at < L:  # the tail is a padding "sequence" of its own: it restarts the positions too
            pos[r, at:] = ar[: L - at]
    return packed, pos, index


def _packed_logits(model, ids: torch.Tensor, lengths: list[int], pad_id: int) -> torch.Tensor:
    packed, pos, index = _packed(ids, lengths, pad_id)
    # no cache: transformers reads position restarts as sequence boundaries only without one
    logits = model(input_ids=packed, position_ids=pos, use_cache=False).logits  # (R, C, V)
    flat = logits.reshape(-1, logits.shape[-1])
    return flat.index_select(0, index.reshape(-1)).reshape(*ids.shape, -1)  # (B, L, V)


@torch.no_grad()
def supports_packing(model, pad_id: int) -> bool:
    """Whether a packed pass gives this model the logits of separate passes (checked once, then remembered)."""
    known = getattr(model, "_rail_packing_ok", None)
    if known is not None:
        return known
    was = model.training
    model.eval()
    try:
        g = torch.Generator().manual_seed(0)
        vocab = model.get_input_embeddings().weight.shape[0]
        device = next(model.parameters()).device
        seqs = [torch.randint(0, vocab, (n,), generator=g).to(device) for n in (7, 5, 11)]
        L = 12  # rows: [11] and [7, 5]
        ids = torch.full((3, L), pad_id, dtype=torch.long, device=device)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = s
        got = _packed_logits(model, ids, [len(s) for s in seqs], pad_id)
        ok = all(torch.allclose(got[b, : len(s)].float(), model(input_ids=s[None]).logits[0].float(), atol=_ATOL)
                 for b, s in enumerate(seqs))
    except Exception:  # any failure of the packed path means: do not use it
        ok = False
    finally:
        model.train(was)
    model._rail_packing_ok = ok
    return ok


def forward_logits(model, ids: torch.Tensor, attn: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Logits (B, L, V) of a right-padded batch; packed when the model supports it and rows are short enough
    (see the module doc)."""
    if ids.shape[1] <= PACK_MAX_TOKENS and supports_packing(model, pad_id):
        lengths = [int(n) for n in attn.sum(dim=1).tolist()]
        if min(lengths) > 0:
            return _packed_logits(model, ids, lengths, pad_id)
    return model(input_ids=ids).logits  # right padding: causal attention alone keeps each sequence to itself


def _packed_hidden(model, ids: torch.Tensor, lengths: list[int], pad_id: int) -> torch.Tensor:
    packed, pos, index = _packed(ids, lengths, pad_id)
    h = model.get_decoder()(input_ids=packed, position_ids=pos, use_cache=False).last_hidden_state  # (R, C, H)
    flat = h.reshape(-1, h.shape[-1])
    return flat.index_select(0, index.reshape(-1)).reshape(*ids.shape, -1)  # (B, L, H)


def forward_hidden(model, ids: torch.Tensor, attn: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The decoder's last hidden states (B, L, H) of a right-padded batch, packed as :func:`forward_logits` packs:
    what the vocabulary projection turns into logits."""
    if ids.shape[1] <= PACK_MAX_TOKENS and supports_packing(model, pad_id):
        lengths = [int(n) for n in attn.sum(dim=1).tolist()]
        if min(lengths) > 0:
            return _packed_hidden(model, ids, lengths, pad_id)
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


def _chunk_logprobs(head, h: torch.Tensor, targets: torch.Tensor, temperature: float,
                    entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(h).float()  # (n, V)
    if temperature > 0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse  # (n,)
    if not entropy:
        return logp, torch.zeros_like(logp)
    with torch.no_grad():
        p = torch.softmax(logits, dim=-1)
        ent = lse - (p * logits).sum(-1)  # (n,): H = logsumexp - E_p[logit]
    return logp, ent


def token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, pad_id: int, temperature: float = 1.0,
                   chunk: int = 0, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (B, T) of each next token ``ids[:, 1:]`` under ``model`` (logits divided by
    ``temperature`` when > 0), and with ``entropy`` the next-token entropies (B, T) (detached).

    ``chunk = 0``: from the full logits (B, T, V) (:func:`forward_logits`). ``chunk = n``: the vocabulary
    projection runs ``n`` positions at a time and is recomputed in the backward pass
    (``torch.utils.checkpoint``), so no (B, T, V) tensor exists at once: a 49k-token vocabulary over a batch of
    trajectories would otherwise take gigabytes, several times over (softmax, log-softmax, gradient)."""
    from policy import grpo

    if not chunk:
        logits = forward_logits(model, ids, attn, pad_id)[:, :-1].float()  # (B, T, V)
        if temperature > 0:
            logits = logits / temperature
        logp = grpo.gather_logprobs(logits, ids[:, 1:])  # (B, T)
        return logp, (grpo.token_entropy(logits.detach()) if entropy else None)
    from torch.utils.checkpoint import checkpoint

    h = forward_hidden(model, ids, attn, pad_id)[:, :-1]  # (B, T, H)
    B, T, H = h.shape
    flat, targets = h.reshape(-1, H), ids[:, 1:].reshape(-1)
    head = model.get_output_embeddings()
    lps, ents = [], []
    for i in range(0, B * T, chunk):
        lp, en = checkpoint(_chunk_logprobs, head, flat[i:i + chunk], targets[i:i + chunk], temperature, entropy,
                            use_reentrant=False)
        lps.append(lp)
        ents.append(en)
    logp = torch.cat(lps).reshape(B, T)
    return logp, (torch.cat(ents).reshape(B, T).detach() if entropy else None)
