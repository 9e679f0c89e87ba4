"""Packed forward passes give the logits and gradients of the padded ones, and rows never overflow."""

from __future__ import annotations

import pytest
import torch

from policy.model import build_tiny_model
from policy.packing import forward_logits, pack_rows, supports_packing


def test_pack_rows_first_fit_decreasing():
    rows = pack_rows([5, 3, 7, 2, 4], 8)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert all(sum([5, 3, 7, 2, 4][i] for i in r) <= 8 for r in rows)
    assert rows == [[2], [0, 1], [4, 3]]  # 7 | 5+3 | 4+2
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([9], 8)


def _model():
    return build_tiny_model(40, hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate_size=64,
                            max_positions=64, seed=0, pad_token_id=0, eos_token_id=1)


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids, attn = torch.zeros(len(lengths), L, dtype=torch.long), torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(2, 40, (n,), generator=g)
        attn[b, :n] = 1
    return ids, attn


def test_packed_logits_and_gradients_match_the_padded_pass():
    model = _model()
    assert supports_packing(model, 0)
    ids, attn = _batch([20, 6, 9, 4, 13, 7])  # several short sequences share rows of 20
    m = attn.bool()
    grads = []
    for packed in (True, False):
        model.zero_grad()
        logits = forward_logits(model, ids, attn, 0) if packed else model(input_ids=ids, attention_mask=attn).logits
        out = torch.log_softmax(logits.float(), -1)[..., 3]
        (out * m).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if packed:
            ref = out.detach()
        else:
            assert torch.allclose(ref[m], out.detach()[m], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))


def test_models_that_cannot_pack_and_long_rows_take_the_unmasked_padded_pass(monkeypatch):
    """The padded pass takes no attention mask (right padding: causal attention never reaches it), and matches
    the masked pass on every real token; rows longer than PACK_MAX_TOKENS are not packed."""
    import policy.packing as P

    model = _model()
    ids, attn = _batch([8, 3])
    m = attn.bool()
    masked = model(input_ids=ids, attention_mask=attn).logits
    model._rail_packing_ok = False  # what the one-off check records for such a model
    assert torch.allclose(forward_logits(model, ids, attn, 0)[m], masked[m], atol=1e-5)
    model._rail_packing_ok = True
    monkeypatch.setattr(P, "PACK_MAX_TOKENS", 4)
    calls = []
    monkeypatch.setattr(P, "_packed_logits", lambda *a: calls.append(a))
    assert torch.allclose(forward_logits(model, ids, attn, 0)[m], masked[m], atol=1e-5) and not calls


def test_chunked_logprobs_match_the_full_logits_and_their_gradient():
    """token_logprobs with chunk = n (the vocabulary projection n positions at a time, recomputed in the backward
    pass) gives the log-probs, entropies and gradient of the full logits, to float tolerance."""
    from policy.model import build_tiny_model
    from policy.packing import token_logprobs

    m = build_tiny_model(50, hidden_size=16, layers=2, heads=2, kv_heads=1, intermediate_size=32, max_positions=64,
                         seed=0, pad_token_id=0, eos_token_id=1)
    ids = torch.randint(2, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    ids[1, 9:], attn[1, 9:] = 0, 0
    full, ent_full = token_logprobs(m, ids, attn, 0, 0.7, 0, entropy=True)
    part, ent_part = token_logprobs(m, ids, attn, 0, 0.7, 5, entropy=True)
    assert torch.allclose(full, part, atol=1e-5) and torch.allclose(ent_full, ent_part, atol=1e-5)
    full.sum().backward()
    g_full = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    part.sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-5) for a, p in zip(g_full, m.parameters()))
