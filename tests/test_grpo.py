"""The pure GRPO math in ``policy/grpo.py``, checked against numbers worked out by hand in each test."""

from __future__ import annotations

import math

import pytest
import torch

from policy import grpo
from policy.records import zero_variance

MODES = ["token_mean", "seq_mean", "dr_grpo"]


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------- advantages
def test_advantages_two_groups_std():
    # group 7: rewards [1, 0, 0, 1] -> mean 0.5, deviations +-0.5, sum of squares 1,
    #          unbiased var 1/3, std 0.57735 -> advantages +-0.5 / 0.57735 = +-0.86603
    # group 3: rewards [2, 4, 6] -> mean 4, deviations [-2, 0, 2], sum of squares 8, var 8/2 = 4, std 2
    #          -> advantages [-1, 0, 1]
    # group ids are not contiguous and not sorted on purpose
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3])
    adv = grpo.group_advantages(rewards, groups)
    assert adv.shape == (7,)
    assert close(adv, [0.86603, -0.86603, -0.86603, 0.86603, -1.0, 0.0, 1.0])


def test_advantages_interleaved_groups():
    # same two groups as above, members interleaved: the grouping, not the order, decides
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 6.0, 1.0])
    groups = torch.tensor([0, 1, 0, 1, 0, 1, 0])
    adv = grpo.group_advantages(rewards, groups)
    assert close(adv, [0.86603, -1.0, -0.86603, 0.0, -0.86603, 1.0, 0.86603])


def test_advantages_none_scale_is_dr_grpo():
    # Dr. GRPO: only the group mean is subtracted
    # group 0: [1, 0, 0, 1] - 0.5 -> [0.5, -0.5, -0.5, 0.5];  group 1: [2, 4, 6] - 4 -> [-2, 0, 2]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    adv = grpo.group_advantages(rewards, groups, scale="none")
    assert close(adv, [0.5, -0.5, -0.5, 0.5, -2.0, 0.0, 2.0])


@pytest.mark.parametrize("scale", ["std", "none"])
def test_advantages_single_member_group_is_zero(scale):
    # group 0: [1, 0] -> mean 0.5, deviations +-0.5, unbiased var (0.25 + 0.25) / 1 = 0.5, std 0.70711
    #          -> "std": +-0.5 / 0.70711 = +-0.70711, "none": +-0.5
    # group 1: the single reward 5 has no baseline -> 0
    rewards = torch.tensor([1.0, 0.0, 5.0])
    groups = torch.tensor([0, 0, 1])
    adv = grpo.group_advantages(rewards, groups, scale=scale)
    expected = [0.70711, -0.70711, 0.0] if scale == "std" else [0.5, -0.5, 0.0]
    assert close(adv, expected)
    assert torch.isfinite(adv).all()


def test_advantages_constant_group_is_zero_not_nan():
    # std 0 -> 0 / (0 + eps) = 0
    adv = grpo.group_advantages(torch.tensor([3.0, 3.0, 3.0]), torch.tensor([0, 0, 0]))
    assert close(adv, [0.0, 0.0, 0.0])


def test_advantages_eps_in_denominator():
    # [0, 2]: mean 1, unbiased std sqrt(2) = 1.41421; eps = 1 -> 1 / 2.41421 = 0.41421
    adv = grpo.group_advantages(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), eps=1.0)
    assert close(adv, [-0.41421, 0.41421])


def test_advantages_integer_rewards_and_dtype():
    adv = grpo.group_advantages(torch.tensor([1, 0, 0, 1]), torch.tensor([0, 0, 0, 0]))
    assert adv.is_floating_point()
    assert close(adv, [0.86603, -0.86603, -0.86603, 0.86603])
    adv64 = grpo.group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0]))
    assert adv64.dtype == torch.float64


def test_advantages_unknown_scale():
    with pytest.raises(ValueError) as e:
        grpo.group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), scale="mad")
    assert "std" in str(e.value) and "none" in str(e.value) and "mad" in str(e.value)


def test_zero_variance_by_hand():
    # [1, 1, 1]          -> population std 0        < 1e-3 -> True
    # [0, 1]             -> population std 0.5      >= tol -> False
    # [0.5, 0.5004]      -> mean 0.5002, deviations +-0.0002, population std 0.0002 < 1e-3 -> True
    # [0.5, 0.504]       -> population std 0.002 >= 1e-3 -> False
    # [9] (one member)   -> std 0 -> True; [] -> True (no advantage either)
    groups = [[1.0, 1.0, 1.0], [0.0, 1.0], [0.5, 0.5004], [0.5, 0.504], [9.0], []]
    assert [zero_variance(g) for g in groups] == [True, False, True, False, True, True]
    # a looser tolerance catches [0.5, 0.504] as well (0.002 < 0.01)
    assert [zero_variance(g, tol=1e-2) for g in groups] == [True, False, True, True, True, True]


# ---------------------------------------------------------------------------------------------- per token
def test_entropy_uniform_is_log_v():
    # softmax of equal logits is uniform over V = 5 -> H = -5 * (1/5) log(1/5) = log 5 = 1.60944
    logits = torch.full((2, 3, 5), 0.7)
    h = grpo.token_entropy(logits)
    assert h.shape == (2, 3)
    assert close(h, torch.full((2, 3), math.log(5)))


def test_entropy_hand_value_and_stability():
    # logits [0, log 3] -> p = [1/4, 3/4] -> H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.34657 + 0.21576 = 0.56233
    # adding 1000 to every logit changes nothing (log_softmax is shift invariant, no overflow)
    logits = torch.tensor([[[0.0, math.log(3.0)], [1000.0, 1000.0 + math.log(3.0)]]])
    h = grpo.token_entropy(logits)
    assert close(h, [[0.56233, 0.56233]])


def test_entropy_with_neg_inf_logits_is_finite():
    # [0, 0, -inf] -> p = [0.5, 0.5, 0] -> H = ln 2 = 0.69315; the 0 * log 0 term is 0, also in the gradient
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]], requires_grad=True)
    h = grpo.token_entropy(logits)
    assert close(h, [[math.log(2.0)]])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_gather_logprobs():
    # row 0: logits [0, ln 3] -> p = [0.25, 0.75]; picking id 1 -> ln 0.75 = -0.28768, id 0 -> ln 0.25 = -1.38629
    # row 1: logits [5, 5, 5, 5] -> uniform over 4; any id -> ln 0.25
    logits = torch.tensor([[[0.0, math.log(3.0), -1e9, -1e9], [5.0, 5.0, 5.0, 5.0]],
                           [[0.0, math.log(3.0), -1e9, -1e9], [5.0, 5.0, 5.0, 5.0]]])
    ids = torch.tensor([[1, 2], [0, 3]])
    lp = grpo.gather_logprobs(logits, ids)
    assert lp.shape == (2, 2)
    assert close(lp, [[math.log(0.75), math.log(0.25)], [math.log(0.25), math.log(0.25)]])
    # same as the full log-softmax, on random numbers
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g)
    ids = torch.randint(0, 11, (3, 4), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    assert close(grpo.gather_logprobs(logits, ids), ref)


def test_k3_hand_value():
    # logp = ln 0.5, ref = ln 0.25 -> r = ref - logp = ln 0.5 = -0.69315
    # k3 = exp(r) - r - 1 = 0.5 + 0.69315 - 1 = 0.19315
    # swapped: r = ln 2 = 0.69315 -> 2 - 0.69315 - 1 = 0.30685
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    assert close(grpo.k3_kl(logp, ref), [[0.19315, 0.30685]])


def test_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 7, generator=g) * 5
    ref = -torch.rand(4, 7, generator=g) * 5
    assert (grpo.k3_kl(logp, ref) >= 0).all()
    assert torch.equal(grpo.k3_kl(logp, logp), torch.zeros(4, 7))


def test_k3_expectation_is_exact_kl():
    # E_p[k3] = sum_v p_v (q_v/p_v - ln(q_v/p_v) - 1) = sum q - 1 + KL(p||q) = KL(p||q)
    # p = [0.5, 0.5], q = [0.25, 0.75]: KL = 0.5 ln 2 + 0.5 ln(2/3) = 0.34657 - 0.20273 = 0.14384
    p = torch.tensor([0.5, 0.5])
    q = torch.tensor([0.25, 0.75])
    k3 = grpo.k3_kl(p.log()[None], q.log()[None])[0]
    assert close((p * k3).sum(), 0.14384)


# ---------------------------------------------------------------------------------------------- aggregation
# x = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] with mask [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
#   token_mean: (1 + 2 + 4) / 3                       = 7/3 = 2.33333
#   seq_mean:   row means 1.5 and 4, empty row 2 left out -> (1.5 + 4) / 2 = 2.75
#   dr_grpo:    (1 + 2 + 4) / (3 sequences * 4 max_tokens) = 7/12 = 0.58333
# gradients (d/dx on masked tokens, 0 elsewhere):
#   token_mean 1/3 each; seq_mean row 0: 1/2 * 1/2 = 0.25, row 1: 1/2 * 1 = 0.5; dr_grpo 1/12 each
RAGGED_X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
RAGGED_MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
RAGGED_EXPECTED = {
    "token_mean": (7 / 3, [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0], [0, 0, 0]]),
    "seq_mean": (2.75, [[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]]),
    "dr_grpo": (7 / 12, [[1 / 12, 1 / 12, 0], [1 / 12, 0, 0], [0, 0, 0]]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_aggregate_ragged(mode, mask_dtype):
    x = torch.tensor(RAGGED_X, requires_grad=True)
    mask = torch.tensor(RAGGED_MASK).to(mask_dtype)
    out = grpo.aggregate(x, mask, mode, max_tokens=4)
    value, grad = RAGGED_EXPECTED[mode]
    assert out.dim() == 0
    assert close(out, value)
    out.backward()
    assert close(x.grad, grad)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_ignores_nan_outside_mask(mode):
    x = torch.tensor(RAGGED_X)
    x[0, 2], x[2, 0] = float("nan"), float("inf")
    x.requires_grad_(True)
    out = grpo.aggregate(x, torch.tensor(RAGGED_MASK, dtype=torch.bool), mode, max_tokens=4)
    assert close(out, RAGGED_EXPECTED[mode][0])
    out.backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_empty_mask_is_differentiable_zero(mode):
    x = torch.randn(2, 3, requires_grad=True)
    out = grpo.aggregate(x, torch.zeros(2, 3, dtype=torch.bool), mode, max_tokens=3)
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad, torch.zeros(2, 3))


def test_aggregate_dr_grpo_needs_max_tokens():
    with pytest.raises(ValueError, match="max_tokens"):
        grpo.aggregate(torch.ones(1, 2), torch.ones(1, 2), "dr_grpo")


def test_aggregate_unknown_mode_lists_valid():
    with pytest.raises(ValueError) as e:
        grpo.aggregate(torch.ones(1, 2), torch.ones(1, 2), "sum")
    for m in MODES:
        assert m in str(e.value)


# ---------------------------------------------------------------------------------------------- shaping
# H = [1, 2, 3, 100], mask = [T, T, T, F] -> stats over [1, 2, 3]: mean 2, population std sqrt(2/3) = 0.81650
# z = [-1.22474, 0, 1.22474, (irrelevant)]; adv = 2 everywhere; coef 0.5; shape_mask = [T, F, T, F]
#   t0: 2 * (1 + 0.5 * -1.22474) = 2 * 0.38763 = 0.77526
#   t1: not shaped -> 2;  t2: 2 * (1 + 0.61237) = 3.22474;  t3: not shaped -> 2 (its huge entropy is ignored)
def _shaping_inputs():
    adv = torch.full((1, 4), 2.0)
    ent = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    shape = torch.tensor([[True, False, True, False]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    return adv, ent, shape, mask


def test_entropy_shaping_hand_numbers():
    adv, ent, shape, mask = _shaping_inputs()
    out = grpo.entropy_shaped_advantages(adv, ent, shape, mask, coef=0.5)
    assert close(out, [[0.77526, 2.0, 3.22474, 2.0]])


def test_entropy_shaping_stats_use_mask_not_shape_mask():
    # stats over the trainable tokens even if only one is shaped: shape only t2 -> 3.22474, rest unchanged
    adv, ent, _, mask = _shaping_inputs()
    shape = torch.tensor([[False, False, True, False]])
    out = grpo.entropy_shaped_advantages(adv, ent, shape, mask, coef=0.5)
    assert close(out, [[2.0, 2.0, 3.22474, 2.0]])


def test_entropy_shaping_coef_zero_is_identity():
    adv, ent, shape, mask = _shaping_inputs()
    adv = torch.randn(1, 4)
    out = grpo.entropy_shaped_advantages(adv, ent, shape, mask, coef=0.0)
    assert torch.equal(out, adv)


def test_entropy_shaping_no_gradient_into_entropy():
    adv, ent, shape, mask = _shaping_inputs()
    ent = ent.clone().requires_grad_(True)
    # with a constant advantage nothing in the output may depend on the (detached) entropy
    out = grpo.entropy_shaped_advantages(adv, ent, shape, mask, coef=0.5)
    assert not out.requires_grad
    # with a differentiable advantage the gradient reaches adv (the factor 1 + coef z) and never entropy
    adv = adv.clone().requires_grad_(True)
    out = grpo.entropy_shaped_advantages(adv, ent, shape, mask, coef=0.5)
    out.sum().backward()
    assert ent.grad is None
    assert close(adv.grad, [[0.38763, 1.0, 1.61237, 1.0]])


def test_entropy_shaping_empty_mask_is_finite():
    adv, ent, shape, _ = _shaping_inputs()
    out = grpo.entropy_shaped_advantages(adv, ent, shape, torch.zeros(1, 4), coef=0.5)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------- ppo clip loss
def _ppo_inputs(ratios, advs, mask=None):
    """One sequence (B = 1) with the given ratios: old_logp = 0, logp = ln ratio."""
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([advs], dtype=torch.float64)
    mask = torch.ones_like(adv) if mask is None else torch.tensor([mask], dtype=torch.float64)
    return logp, old, adv, mask


@pytest.mark.parametrize("mode", MODES)
def test_ppo_inside_clip_range_is_plain_ratio_times_adv(mode):
    # ratios [1.1, 0.9, 1.05] all inside [0.8, 1.2]; A = [1, -2, 0.5]
    # per token -ratio * A = [-1.1, 1.8, -0.525] -> mean 0.175 / 3 = 0.058333
    # (one sequence of 3 tokens and max_tokens = 3, so all three modes agree)
    # gradient d/dlogp_t = -A_t * ratio_t / 3 = [-0.36667, 0.6, -0.175]
    logp, old, adv, mask = _ppo_inputs([1.1, 0.9, 1.05], [1.0, -2.0, 0.5])
    loss, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.2, mode, max_tokens=3))
    assert close(loss, 0.058333)
    assert close(st["pg_loss"], 0.058333)
    assert st["clip_frac"] == 0.0
    loss.backward()
    assert close(logp.grad, [[-1.1 / 3, 1.8 / 3, -0.525 / 3]])


@pytest.mark.parametrize("mode", MODES)
def test_ppo_ratio_above_high_positive_adv_is_clipped(mode):
    # t0: ratio 1.5 > 1 + 0.28, A = 2 -> min(3.0, 1.28 * 2 = 2.56) = 2.56 -> loss -2.56, zero gradient
    # t1: ratio 1.0, A = 1 -> loss -1.0, gradient -1 * 1 / 2 = -0.5
    # mean (-2.56 - 1.0) / 2 = -1.78
    logp, old, adv, mask = _ppo_inputs([1.5, 1.0], [2.0, 1.0])
    loss, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, mode, max_tokens=2))
    assert close(loss, -1.78)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert close(logp.grad, [[0.0, -0.5]])
    assert st["clip_frac"] == 0.5 and st["clip_frac_high"] == 0.5 and st["clip_frac_low"] == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_ppo_ratio_below_low_negative_adv_is_clipped(mode):
    # t0: ratio 0.5 < 1 - 0.2, A = -1 -> min(-0.5, 0.8 * -1 = -0.8) = -0.8 -> loss 0.8, zero gradient
    # t1: ratio 0.5, A = +1 -> min(0.5, 0.8) = 0.5 (unclipped: the low bound binds only for A < 0)
    #     -> loss -0.5, gradient -A * ratio / 2 = -0.25
    # mean (0.8 - 0.5) / 2 = 0.15
    logp, old, adv, mask = _ppo_inputs([0.5, 0.5], [-1.0, 1.0])
    loss, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.2, mode, max_tokens=2))
    assert close(loss, 0.15)
    loss.backward()
    assert close(logp.grad, [[0.0, -0.25]])
    assert st["clip_frac"] == 0.5 and st["clip_frac_low"] == 0.5 and st["clip_frac_high"] == 0.0


def test_ppo_ratio_above_high_negative_adv_is_not_clipped():
    # ratio 1.5, A = -1 -> min(-1.5, 1.2 * -1 = -1.2) = -1.5 -> loss 1.5; gradient -A * ratio = 1.5
    logp, old, adv, mask = _ppo_inputs([1.5], [-1.0])
    loss, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.2, "token_mean"))
    assert close(loss, 1.5)
    loss.backward()
    assert close(logp.grad, [[1.5]])
    assert st["clip_frac"] == 0.0


def test_ppo_asymmetric_clip_higher():
    # eps_low 0.2, eps_high 0.28 -> interval [0.8, 1.28]; ratios [1.25, 1.30, 0.75, 0.85], A = [1, 1, -1, -1]
    #   t0: 1.25 inside            -> -1.25
    #   t1: 1.30 > 1.28, A > 0     -> -1.28 (clipped high)
    #   t2: 0.75 < 0.8,  A < 0     -> -min(-0.75, -0.8) = 0.8 (clipped low)
    #   t3: 0.85 inside            -> 0.85
    # token mean (-1.25 - 1.28 + 0.8 + 0.85) / 4 = -0.88 / 4 = -0.22
    # clip_frac 2/4, high 1/4, low 1/4; ratio_mean 4.15 / 4 = 1.0375, ratio_max 1.3
    logp, old, adv, mask = _ppo_inputs([1.25, 1.30, 0.75, 0.85], [1.0, 1.0, -1.0, -1.0])
    loss, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean"))
    assert close(loss, -0.22)
    assert st["clip_frac"] == pytest.approx(0.5)
    assert st["clip_frac_high"] == pytest.approx(0.25)
    assert st["clip_frac_low"] == pytest.approx(0.25)
    assert st["ratio_mean"] == pytest.approx(1.0375)
    assert st["ratio_max"] == pytest.approx(1.3)
    loss.backward()
    # unclipped tokens: -A * ratio / 4 -> t0 -0.3125, t3 0.85 / 4 = 0.2125; clipped tokens 0
    assert close(logp.grad, [[-0.3125, 0.0, 0.0, 0.2125]])
    # with symmetric 0.2 the t0 ratio 1.25 > 1.2 is clipped too: -1.2 instead of -1.25
    #   (-1.2 - 1.2 + 0.8 + 0.85) / 4 = -0.75 / 4 = -0.1875, clip_frac 3/4
    loss_sym, st_sym = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.2, "token_mean"))
    assert close(loss_sym, -0.1875)
    assert st_sym["clip_frac"] == pytest.approx(0.75)


def test_ppo_clip_frac_counts_only_masked_tokens_and_binding_side():
    # tokens: ratio 1.5 A=+1 (clipped high) | 1.5 A=0 (no branch binds) | 1.5 A=-1 (unclipped)
    #         | 0.5 A=-1 (clipped low) | padding: logp -50 (ratio e^-50), masked out
    # clip_frac = 2 / 4 masked tokens = 0.5; high 0.25, low 0.25
    # ratio_mean over masked = (1.5 * 3 + 0.5) / 4 = 1.25; ratio_max 1.5
    logp, old, adv, mask = _ppo_inputs([1.5, 1.5, 1.5, 0.5, math.exp(-50)], [1.0, 0.0, -1.0, -1.0, 5.0],
                                       mask=[1, 1, 1, 1, 0])
    _, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.2, "token_mean"))
    assert st["clip_frac"] == pytest.approx(0.5)
    assert st["clip_frac_high"] == pytest.approx(0.25)
    assert st["clip_frac_low"] == pytest.approx(0.25)
    assert st["ratio_mean"] == pytest.approx(1.25)
    assert st["ratio_max"] == pytest.approx(1.5)
    assert all(isinstance(v, float) for v in st.values())


# ragged batch with ratio 1 (logp == old_logp): per-token loss = -A
#   row 0: A = [1, 1, 9 (masked)]; row 1: A = [4, 9 (masked), 9 (masked)]
#   token_mean: -(1 + 1 + 4) / 3 = -2;  seq_mean: -(1 + 4) / 2 = -2.5;  dr_grpo (max 3): -6 / (2 * 3) = -1
@pytest.mark.parametrize("mode,expected", [("token_mean", -2.0), ("seq_mean", -2.5), ("dr_grpo", -1.0)])
def test_ppo_aggregation_modes_on_ragged_batch(mode, expected):
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, st = grpo.policy_loss(logp, torch.zeros(2, 3), adv, mask, grpo.LossSettings(0.2, 0.2, mode, max_tokens=3))
    assert close(loss, expected)
    assert st["pg_loss"] == pytest.approx(expected)


@pytest.mark.parametrize("mode", MODES)
def test_ppo_empty_mask(mode):
    logp = torch.randn(2, 3, requires_grad=True)
    loss, st = grpo.policy_loss(logp, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3),
                                grpo.LossSettings(0.2, 0.2, mode, max_tokens=3, kl_coef=0.1),
                                ref_logp=torch.randn(2, 3))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert all(v == 0.0 for v in st.values())


def test_ppo_kl_term():
    # A = 0 -> no policy gradient part; logp = ln 0.5, ref = ln 0.25 -> k3 = 0.19315 (see test_k3_hand_value)
    # loss = 0.1 * 0.19315 = 0.019315; stats kl = 0.19315, pg_loss = 0
    # d k3 / d logp = -exp(r) + 1 = 1 - 0.5 = 0.5 -> grad 0.1 * 0.5 = 0.05
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    loss, st = grpo.policy_loss(logp, logp.detach(), torch.zeros(1, 1), torch.ones(1, 1),
                                grpo.LossSettings(0.2, 0.2, "token_mean", kl_coef=0.1), ref_logp=ref)
    assert close(loss, 0.019315)
    assert st["kl"] == pytest.approx(0.19315, abs=1e-5)
    assert st["pg_loss"] == 0.0
    loss.backward()
    assert close(logp.grad, [[0.05]])
    # kl_coef 0: the stat is still reported, the loss has no KL part
    loss0, st0 = grpo.policy_loss(logp, logp.detach(), torch.zeros(1, 1), torch.ones(1, 1),
                                  grpo.LossSettings(0.2, 0.2, "token_mean", kl_coef=0.0), ref_logp=ref)
    assert loss0.item() == 0.0 and st0["kl"] == pytest.approx(0.19315, abs=1e-5)
    # no reference: kl stat 0
    _, st_none = grpo.policy_loss(logp, logp.detach(), torch.zeros(1, 1), torch.ones(1, 1),
                                  grpo.LossSettings(0.2, 0.2, "token_mean"))
    assert st_none["kl"] == 0.0


def test_ppo_kl_stat_ignores_masked_tokens():
    # masked token has a huge ref gap; kl over the one masked-in token (k3 = 0 since ref == logp) stays 0
    logp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.0, -30.0]])
    _, st = grpo.policy_loss(logp, logp, torch.ones(1, 2), torch.tensor([[1.0, 0.0]]),
                             grpo.LossSettings(0.2, 0.2, "token_mean", kl_coef=0.1), ref_logp=ref)
    assert st["kl"] == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_ppo_gradient_matches_finite_differences(mode):
    g = torch.Generator().manual_seed(3)
    B, T = 3, 5
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # ratios spread over [0.6, 1.5] so some tokens clip and some do not; none sits on a clip boundary
    logp = (old + torch.empty(B, T, dtype=torch.float64).uniform_(math.log(0.6), math.log(1.5), generator=g))
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    ratio = (logp - old).exp()
    assert ((ratio - 0.8).abs() > 1e-3).all() and ((ratio - 1.2).abs() > 1e-3).all()
    logp.requires_grad_(True)

    def f(lp):
        return grpo.policy_loss(lp, old, adv, mask,
                                grpo.LossSettings(0.2, 0.2, mode, max_tokens=T, kl_coef=0.05), ref_logp=ref)[0]

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-6, atol=1e-6)


def test_ppo_gradient_analytic_unclipped():
    # all ratios inside the interval and no KL: d loss / d logp_t = -A_t * ratio_t / n (token_mean)
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    logp = (old + torch.empty(2, 4, dtype=torch.float64).uniform_(-0.1, 0.1, generator=g)).requires_grad_(True)
    adv = torch.randn(2, 4, generator=g, dtype=torch.float64)
    loss, _ = grpo.policy_loss(logp, old, adv, torch.ones(2, 4), grpo.LossSettings(0.2, 0.2, "token_mean"))
    loss.backward()
    assert close(logp.grad, -adv * (logp.detach() - old).exp() / 8, tol=1e-10)


def test_ppo_no_gradient_into_old_or_ref():
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.full((1, 2), -0.1, requires_grad=True)
    ref = torch.full((1, 2), -0.2, requires_grad=True)
    loss, _ = grpo.policy_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2),
                               grpo.LossSettings(0.2, 0.2, "token_mean", kl_coef=0.1), ref_logp=ref)
    loss.backward()
    assert old.grad is None and ref.grad is None and logp.grad is not None


def test_ppo_unknown_aggregation():
    with pytest.raises(ValueError) as e:
        grpo.policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                         grpo.LossSettings(0.2, 0.2, "mean"))
    for m in MODES:
        assert m in str(e.value)


def test_learning_rate_schedule_runs_on_training_steps():
    """The schedule advances once per training step, whether the filters left 0, 1 or several minibatches,
    so a cosine schedule over ``run.steps`` ends at 0 at the last step."""
    from policy.learner import GRPOLearner, LearnerSettings, PreparedBatch

    model = torch.nn.Linear(2, 2)
    learner = GRPOLearner(model, LearnerSettings(lr=1e-3, schedule="cosine", warmup_steps=2, rehearsal=0.0),
                          total_steps=6, pad_id=0)
    rates = [learner.update(PreparedBatch([], [], {}), torch.Generator())["lr"] for _ in range(6)]
    assert rates[:2] == pytest.approx([0.5e-3, 1e-3])  # warm-up, in training steps
    expected = [1e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert rates[2:] == pytest.approx(expected)
    assert learner.scheduler.get_last_lr()[0] == pytest.approx(0.0)


# ---------------------------------------------------------------------------------------------- numerical guards
def _far(log_ratios, adv, dtype=torch.float32):
    """One sequence in ``dtype`` whose tokens have the given log-ratios logp - old_logp (logp = -1)."""
    logp = torch.full((1, len(log_ratios)), -1.0, dtype=dtype, requires_grad=True)
    old = logp.detach() - torch.tensor([log_ratios], dtype=dtype)
    return logp, old, torch.tensor([adv], dtype=dtype), torch.ones(1, len(log_ratios), dtype=dtype)


@pytest.mark.parametrize("lr", [50.0, -50.0, 100.0, -100.0, 1e4])
@pytest.mark.parametrize("a", [1.0, -1.0])
@pytest.mark.parametrize("mode", MODES)
def test_ppo_float32_far_log_ratios_give_finite_loss_and_gradient(lr, a, mode):
    # without the clamp, log-ratio 100 in float32 is exp(100) = inf: loss inf (A < 0), gradient NaN (A > 0)
    logp, old, adv, mask = _far([lr, 0.0], [a, a])
    ref = logp.detach() + torch.tensor([[lr, 0.0]])  # the KL term sees the same gap
    loss, st = grpo.policy_loss(logp, old, adv, mask,
                                grpo.LossSettings(0.2, 0.28, mode, max_tokens=2, kl_coef=0.1), ref_logp=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in st.values())


def test_ppo_log_ratio_is_clamped_at_20_hand_numbers():
    # log-ratio 50, A = -1: ratio exp(clamp(50)) = exp(20) = 4.85165e8, unclipped for A < 0 -> loss exp(20);
    # the second token has ratio 1, A = -1 -> loss 1. token mean (exp(20) + 1) / 2. The clamped token has zero
    # gradient (the clamp is flat there, as in verl); the other -A * ratio / 2 = 0.5.
    logp, old, adv, mask = _far([50.0, 0.0], [-1.0, -1.0], torch.float64)
    loss, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean"))
    assert loss.item() == pytest.approx((math.exp(20.0) + 1) / 2, rel=1e-12)
    assert st["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-12)
    loss.backward()
    assert close(logp.grad, [[0.0, 0.5]])
    # log-ratio -50, A = +1: ratio exp(-20) = 2.06115e-9 inside no clip branch for A > 0 -> loss -exp(-20)
    logp, old, adv, mask = _far([-50.0], [1.0], torch.float64)
    loss, _ = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean"))
    assert loss.item() == pytest.approx(-math.exp(-20.0), rel=1e-12)


def test_ppo_dual_clip_hand_numbers():
    # c = 3. ratios [5, 2, 0.5, 5], A = [-1, -1, -1, +2]:
    #   t0: A < 0, PPO loss -min(-5, -1.28) = 5 > 3 -> dual clip: 3, zero gradient
    #   t1: A < 0, ratio 2 < c -> PPO loss 2 (unclipped for A < 0), gradient -A * ratio / 4 = 0.5
    #   t2: A < 0, ratio 0.5 < 0.8 -> clipped low: 0.8, zero gradient
    #   t3: A > 0, ratio 5 > 1.28 -> clipped high: -2.56, zero gradient (dual clip never touches A > 0)
    # token mean (3 + 2 + 0.8 - 2.56) / 4 = 3.24 / 4 = 0.81; clip_frac_dual 1/4, clip_frac 2/4
    logp, old, adv, mask = _ppo_inputs([5.0, 2.0, 0.5, 5.0], [-1.0, -1.0, -1.0, 2.0])
    loss, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean", clip_ratio_c=3.0))
    assert close(loss, 0.81)
    assert st["clip_frac_dual"] == 0.25 and st["clip_frac"] == 0.5
    loss.backward()
    assert close(logp.grad, [[0.0, 0.5, 0.0, 0.0]])
    # off (the default): t0 keeps its PPO loss 5 -> (5 + 2 + 0.8 - 2.56) / 4 = 1.31
    logp, old, adv, mask = _ppo_inputs([5.0, 2.0, 0.5, 5.0], [-1.0, -1.0, -1.0, 2.0])
    loss, st = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean"))
    assert close(loss, 1.31) and st["clip_frac_dual"] == 0.0
    # float32, log-ratio 50, A = -1, c = 3: the loss is 3, not exp(20)
    logp, old, adv, mask = _far([50.0], [-1.0])
    loss, _ = grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean", clip_ratio_c=3.0))
    assert loss.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean", clip_ratio_c=0.5))


def test_k3_is_capped_at_10_with_clamped_log_ratio():
    # r = ref - logp = 50 -> clamp 20 -> exp(20) - 21 -> cap 10; r = -50 -> clamp -20 -> exp(-20) + 19 -> cap 10;
    # r = 2 -> exp(2) - 3 = 4.38906 (below the cap, unchanged). Capped tokens have zero gradient.
    logp = torch.zeros(1, 3, requires_grad=True)
    ref = torch.tensor([[50.0, -50.0, 2.0]])
    k3 = grpo.k3_kl(logp, ref)
    assert close(k3, [[10.0, 10.0, math.exp(2.0) - 3.0]])
    k3.sum().backward()
    # d k3 / d logp = 1 - exp(r) at r = 2: 1 - 7.38906 = -6.38906
    assert close(logp.grad, [[0.0, 0.0, 1.0 - math.exp(2.0)]])


def test_policy_loss_is_its_named_terms_composed_in_order():
    """Every term on at once: the loss is the terms of grpo chained in policy_loss's documented order, token by
    token (dual clip on the clipped term, shaping in its place on guided tokens, the IS weight on what is left,
    then rationalization and KL added), and its gradient is theirs."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_()
    old = -torch.rand(3, 5, generator=g) * 3
    ref = -torch.rand(3, 5, generator=g) * 3
    adv = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.2
    guided = torch.rand(3, 5, generator=g) > 0.5
    w = torch.rand(3, 5, generator=g) * 2
    cfg = grpo.LossSettings(0.2, 0.28, "seq_mean", clip_ratio_c=3.0, shaping_gamma=0.1, guided_sft=0.5, kl_coef=0.05)
    loss, _ = grpo.policy_loss(logp, old, adv, mask, cfg, guided=guided, ref_logp=ref, is_weight=w)

    lp = logp.detach().clone().requires_grad_()
    rho = grpo.ratio(lp, old, mask)
    pg, _ = grpo.dual_clip(grpo.clipped_surrogate(rho, adv, 0.2, 0.28), adv, 3.0)
    shaped = mask & guided
    pg = torch.where(shaped, grpo.luffy_shaping(torch.where(shaped, lp, torch.zeros_like(lp)), adv, 0.1), pg) * w
    sft, _ = grpo.rationalization(lp, adv, mask & guided)
    per_token = pg + 0.5 * sft + 0.05 * grpo.k3_kl(lp, torch.where(mask, ref, lp.detach()))
    expected = grpo.aggregate(per_token, mask, "seq_mean")
    assert close(loss, float(expected.detach()))
    loss.backward()
    expected.backward()
    assert torch.allclose(logp.grad, lp.grad, atol=1e-6)


def test_update_influence_is_the_first_order_change_of_the_references_likelihood():
    """policy.influence: the influence of a set on the references, checked against the change a plain gradient step
    of the learner's loss on that set actually makes (small learning rate: first order); a set with positive
    advantage on the references themselves raises their likelihood; an empty set has none; weights untouched."""
    from policy.influence import likelihood_gradient, update_influence
    from policy.learner import GRPOLearner, LearnerSettings, sft_loss
    from policy.model import build_tiny_model
    from policy.records import Origin, Trajectory

    model = build_tiny_model(20, hidden_size=16, layers=1, heads=1, kv_heads=1, intermediate_size=16,
                             max_positions=32, seed=0, pad_token_id=0, eos_token_id=1)
    learner = GRPOLearner(model, LearnerSettings(lr=1e-3, rehearsal=0.0, schedule="constant"), total_steps=10,
                          pad_id=0)

    def traj(tokens):
        with torch.no_grad():
            t = Trajectory("t", "f", 1, 0, [2, 3], [2, 3], ids=list(tokens), origin=[int(Origin.POLICY)] * len(tokens),
                           logprobs=[0.0] * len(tokens), turn=[0] * len(tokens))
            lp = torch.log_softmax(model(torch.tensor([[2, 3, *tokens]])).logits[0, 1:-1].float(), -1)
            t.logprobs = [float(lp[i, tok]) for i, tok in enumerate(tokens)]  # on-policy: ratio 1
        return t
    ref = [traj([4, 5, 6]), traj([7, 8])]
    before = [p.detach().clone() for p in model.parameters()]
    up, down, empty = update_influence(learner, ref, [[(ref[0], 1.0), (ref[1], 1.0)], [(traj([9, 10]), -1.0)], []],
                                       total_tokens=5)
    assert up > 0 and empty is None
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))
    # against a real plain gradient step on the second set's loss, weighted by its share of the 5 tokens
    g_ref = likelihood_gradient(model, ref, 0)
    loss, _, _, mask = learner.minibatch_loss([traj([9, 10])], [-1.0])
    loss = loss * float(mask.sum()) / 5
    loss.backward()
    lik0 = -float(sft_loss(model, ref, 0).detach())
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-3 * p.grad
    lik1 = -float(sft_loss(model, ref, 0).detach())
    assert lik1 - lik0 == pytest.approx(down, rel=0.05, abs=1e-9)
    assert g_ref.shape == (sum(p.numel() for p in model.parameters()),)


def _tiny_learner_and_trajectories(**settings):
    from policy.learner import GRPOLearner, LearnerSettings
    from policy.model import build_tiny_model
    from policy.records import Origin, Trajectory

    model = build_tiny_model(20, hidden_size=16, layers=1, heads=1, kv_heads=1, intermediate_size=16,
                             max_positions=32, seed=0, pad_token_id=0, eos_token_id=1)

    def traj(tokens, prompt=(2, 3)):
        origin = [int(Origin.POLICY)] * len(tokens)
        origin[-1] = int(Origin.TOOL)  # an untrained token inside the response
        return Trajectory("t", "f", 1, 0, list(prompt), list(prompt), ids=list(tokens), origin=origin,
                          logprobs=[-2.5 + 0.1 * i for i in range(len(tokens))], turn=[0] * len(tokens))

    trajs = [traj([4, 5, 6]), traj([7, 8, 9, 10, 11, 12]), traj([13, 14]), traj([15, 16, 17, 18], prompt=(2, 3, 19)),
             traj([5])]  # the last has no trained token
    demos = [traj([6, 7, 8]), traj([9, 10, 11, 12, 13])]
    learner = GRPOLearner(model, LearnerSettings(lr=1e-3, schedule="constant", **settings), total_steps=4, pad_id=0,
                          rehearsal_source=lambda n: demos[:n])
    return learner, trajs, demos


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "dr_grpo"])
def test_a_minibatch_trained_in_passes_of_few_tokens_has_the_one_pass_gradient(mode):
    """learner.tokens_per_pass: the minibatch (and its rehearsal) split into forward passes of at most n padded
    tokens, each pass's loss weighted by its share of what the aggregation divides by, gives the gradient and the
    loss of one pass over the whole minibatch, for every aggregation."""
    import dataclasses

    from policy.learner import micro_batches

    advs = [1.0, -0.5, 0.25, -1.0, 0.7]
    grads, losses = [], []
    for tokens in (0, 10):
        learner, trajs, _ = _tiny_learner_and_trajectories(loss_agg=mode, max_tokens=8, rehearsal=0.5,
                                                           rehearsal_batch=2)
        learner.s = dataclasses.replace(learner.s, tokens_per_pass=tokens)
        parts = micro_batches(trajs, tokens)
        assert sorted(i for p in parts for i in p) == list(range(len(trajs)))
        if tokens:
            assert len(parts) >= 3
            for p in parts:  # rows x the longest row's context, or a row alone
                longest = max(len(trajs[i].context_prompt_ids) + len(trajs[i].ids) for i in p)
                assert len(p) == 1 or len(p) * longest <= tokens
        learner.optimizer.zero_grad(set_to_none=True)
        loss, st = learner.accumulate(trajs, advs)
        grads.append([p.grad.clone() for p in learner.model.parameters()])
        losses.append((loss, st["rehearsal_nll"], st["entropy"]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert any(float(g.abs().sum()) > 0 for g in grads[0])


def test_the_warm_starts_loss_in_passes_of_few_tokens_has_the_one_pass_gradient():
    from policy.learner import sft_backward, sft_loss

    learner, trajs, demos = _tiny_learner_and_trajectories(rehearsal=0.0)
    model = learner.model
    model.zero_grad(set_to_none=True)
    whole = sft_loss(model, trajs + demos, 0)
    whole.backward()
    one = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    split = sft_backward(model, trajs + demos, 0, tokens_per_pass=8, weight=1.0)
    assert split == pytest.approx(float(whole.detach()), rel=1e-5)
    for a, p in zip(one, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-4, atol=1e-7)


def test_aggregation_count_is_what_aggregate_divides_by():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert grpo.aggregation_count(mask, "token_mean") == 3
    assert grpo.aggregation_count(mask, "seq_mean") == 2
    assert grpo.aggregation_count(mask, "dr_grpo") == 3
    with pytest.raises(ValueError, match="token_mean"):
        grpo.aggregation_count(mask, "mean")
