"""The pure math of the GRPO learner: advantages, per-token quantities, aggregation and the clipped loss.

Every function here is stateless and takes tensors in, tensors out; the learner (``policy/learner.py``) owns
the model, the optimizer and the batching. Shapes are written as comments: ``N`` trajectories, ``B``
sequences in a micro-batch, ``T`` target positions, ``V`` vocabulary entries.

Sources:

* GRPO -- Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
  Models" (arXiv:2402.03300): group-relative advantages, per-sequence mean of token losses, k3 KL penalty.
* Dr. GRPO -- Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
  (arXiv:2503.20783): no std division in the advantage, constant-length normaliser in the loss.
* DAPO -- Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
  (arXiv:2503.14476): clip-higher (``eps_low != eps_high``), token-level mean, dynamic sampling (dropping
  groups whose rewards are all equal).
* PPO -- Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347): the clipped
  surrogate objective.
* k3 -- J. Schulman, "Approximating KL Divergence" (2020 note): the unbiased, non-negative estimator
  ``exp(r) - r - 1`` with ``r = log ref - log pi``.
* LUFFY -- Yan et al. 2025, "Learning to Reason under Off-Policy Guidance" (arXiv:2504.14945): policy
  shaping ``f(pi) = pi / (pi + gamma)`` on off-policy tokens, without clipping.
* TAO-RL -- the tool-agent recipe this project follows: drop zero-variance groups, and scale the advantage of
  the assistant turn right after a tool result by the standardised token entropy.
* Dual-clip PPO -- Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"
  (arXiv:1912.09729): for ``A < 0`` the loss is also capped at ``c |A|``, so one token whose ratio exploded
  cannot dominate the update (verl's ``clip_ratio_c``, default 3).

Numerical guards, as verl's ``core_algos`` has them: every log-ratio is clamped to
``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before it is exponentiated (in float32 ``exp(90)`` is ``inf``, and
``exp(25) A`` already swamps a batch), and the k3 estimate is capped at ``KL_CAP``. A clamped or capped token
has zero gradient through that term, as in verl.

Masks: wherever a ``mask`` is taken it may be bool or 0/1 float; any non-zero entry counts as a trainable
token. Values at masked-out positions never reach a result or a gradient (they are selected away with
``torch.where``, so even ``inf``/``NaN`` there is harmless).
"""

from __future__ import annotations

import torch
from torch import Tensor

ADV_SCALES = ("std", "none")
AGGREGATIONS = ("token_mean", "seq_mean", "dr_grpo")
#: log-ratios are clamped to [-20, 20] before ``exp`` (verl's ``compute_policy_loss`` and ``low_var_kl``)
LOG_RATIO_CLAMP = 20.0
#: the k3 estimate per token is capped at 10 (verl's ``low_var_kl``)
KL_CAP = 10.0


# ---------------------------------------------------------------------------------------------- helpers
def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-member group count, group mean and group sum of squared deviations, each (N,)."""
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards and group_index must both be (N,); got {tuple(rewards.shape)} "
                         f"and {tuple(group_index.shape)}")
    _, inv = torch.unique(group_index, return_inverse=True)  # (N,) dense ids 0..G-1
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(g, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inv, torch.ones_like(rewards))  # (G,)
    total = torch.zeros(g, dtype=rewards.dtype, device=rewards.device).index_add_(0, inv, rewards)  # (G,)
    mean = total / count  # (G,)
    dev = rewards - mean[inv]  # (N,)
    ss = torch.zeros(g, dtype=rewards.dtype, device=rewards.device).index_add_(0, inv, dev * dev)  # (G,)
    return count[inv], mean[inv], ss[inv]


# ---------------------------------------------------------------------------------------------- advantages
def group_advantages(rewards: Tensor, group_index: Tensor, scale: str = "std", eps: float = 1e-6) -> Tensor:
    """Group-relative advantages, one per trajectory.

    ``A_i = r_i - mean_g``                      (``scale="none"``, Dr. GRPO, Liu et al. 2025)
    ``A_i = (r_i - mean_g) / (std_g + eps)``    (``scale="std"``, GRPO, Shao et al. 2024)

    where ``g`` is the group of trajectory ``i`` and ``std_g`` is the unbiased (sample, ``n - 1``) standard
    deviation of the group's rewards, as GRPO implementations (e.g. TRL) compute it. A group with a single
    member has no baseline to compare against; its advantage is 0.

    Args:
        rewards: (N,) float rewards (integer rewards are promoted to float).
        group_index: (N,) integer group id per trajectory; ids need not be contiguous.
        scale: ``"std"`` or ``"none"``.
        eps: added to ``std_g`` before dividing.

    Returns:
        (N,) advantages, same dtype as ``rewards`` (float).
    """
    if scale not in ADV_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; valid values: {', '.join(ADV_SCALES)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.numel() == 0:
        return rewards.clone()
    count, mean, ss = _group_stats(rewards, group_index)  # (N,) each
    adv = rewards - mean  # (N,)
    if scale == "std":
        std = torch.sqrt(ss / (count - 1).clamp(min=1))  # (N,) unbiased
        adv = adv / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))  # (N,)


def zero_variance_mask(rewards: Tensor, group_index: Tensor, tol: float = 1e-3) -> Tensor:
    """True for every member of a group whose rewards are (numerically) all equal.

    ``mask_i = std_pop(r_g) < tol`` with the population (``n``) standard deviation. Such groups give every
    member the same (zero) advantage, so DAPO's dynamic sampling (Yu et al. 2025) and TAO-RL drop them.
    A single-member group has std 0 and is therefore marked.

    Args:
        rewards: (N,) rewards.
        group_index: (N,) integer group ids.
        tol: groups with population std strictly below this are marked.

    Returns:
        (N,) bool.
    """
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    count, _, ss = _group_stats(rewards, group_index)  # (N,) each
    return torch.sqrt(ss / count) < tol  # (N,)


# ---------------------------------------------------------------------------------------------- per token
def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at every position.

    ``H_t = -sum_v p_v log p_v`` with ``log p = log_softmax(logits)`` (stable for large logits). Entries with
    ``p_v = 0`` (``-inf`` logits) contribute 0, in value and gradient.

    Args:
        logits: (B, T, V).

    Returns:
        (B, T) entropies in nats.
    """
    logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    p = logp.exp()  # (B, T, V)
    logp_finite = logp.masked_fill(~torch.isfinite(logp), 0.0)  # (B, T, V): 0 * -inf -> 0, not NaN
    return -(p * logp_finite).sum(dim=-1)  # (B, T)


def gather_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """Log-probability of the given token at every position.

    ``log pi(y_t) = logits[t, y_t] - logsumexp_v logits[t, v]`` (``= log_softmax(logits)[t, y_t]``, without
    materialising the full (B, T, V) log-softmax).

    Args:
        logits: (B, T, V).
        ids: (B, T) token ids (long).

    Returns:
        (B, T) log-probabilities.
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"logits (B, T, V) and ids (B, T) disagree: {tuple(logits.shape)} vs {tuple(ids.shape)}")
    picked = logits.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)  # (B, T)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of ``KL(pi || ref)`` per sampled token (as in GRPO, Shao et al. 2024).

    ``k3 = min(exp(r) - r - 1, KL_CAP)`` with ``r = clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)``
    (verl's ``low_var_kl``). Unclamped and uncapped, for samples from ``pi`` it is unbiased
    (``E_pi[exp(r)] = 1``); it is ``>= 0`` everywhere, ``= 0`` exactly when ``logp == ref_logp``. A token whose
    estimate reaches the cap (``|r|`` of about 2.4 or more) has zero gradient, so a far-off token cannot blow up
    the loss.

    Args:
        logp: (B, T) log-probabilities under the policy.
        ref_logp: (B, T) log-probabilities under the reference model.

    Returns:
        (B, T) non-negative estimates, at most ``KL_CAP``.
    """
    r = torch.clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    return torch.clamp(torch.exp(r) - r - 1.0, max=KL_CAP)  # (B, T)


# ---------------------------------------------------------------------------------------------- aggregation
def aggregate(x: Tensor, mask: Tensor, mode: str, max_tokens: int | None = None) -> Tensor:
    """Reduce per-token values to a scalar loss.

    With ``m`` the mask, ``|o_i| = sum_t m_it`` and ``B`` sequences:

    * ``"token_mean"`` (DAPO, Yu et al. 2025): ``sum_it x_it m_it / sum_it m_it``.
    * ``"seq_mean"`` (GRPO, Shao et al. 2024): ``(1 / B') sum_i (1/|o_i|) sum_t x_it m_it`` over the ``B'``
      sequences with ``|o_i| > 0`` (sequences with no trainable token are excluded).
    * ``"dr_grpo"`` (Dr. GRPO, Liu et al. 2025): ``sum_it x_it m_it / (B * max_tokens)``, a constant
      normaliser; ``max_tokens`` is required.

    An empty mask gives a zero that is still connected to ``x`` (its gradient is 0, never NaN).

    Args:
        x: (B, T) per-token values.
        mask: (B, T) bool or 0/1.
        mode: one of ``"token_mean"``, ``"seq_mean"``, ``"dr_grpo"``.
        max_tokens: the constant length for ``"dr_grpo"``.

    Returns:
        0-dim tensor.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid values: {', '.join(AGGREGATIONS)}")
    if x.shape != mask.shape or x.dim() != 2:
        raise ValueError(f"x and mask must both be (B, T); got {tuple(x.shape)} and {tuple(mask.shape)}")
    m = _as_bool(mask)  # (B, T)
    xm = torch.where(m, x, torch.zeros_like(x))  # (B, T)
    if mode == "token_mean":
        n = m.sum().clamp(min=1).to(x.dtype)  # ()
        return xm.sum() / n
    if mode == "seq_mean":
        lengths = m.sum(dim=1)  # (B,)
        per_seq = xm.sum(dim=1) / lengths.clamp(min=1).to(x.dtype)  # (B,); 0 for empty sequences
        n_seq = (lengths > 0).sum().clamp(min=1).to(x.dtype)  # ()
        return per_seq.sum() / n_seq
    # dr_grpo
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(f"aggregation 'dr_grpo' needs a positive max_tokens; got {max_tokens!r}")
    return xm.sum() / (x.shape[0] * max_tokens) if x.shape[0] else xm.sum()


# ---------------------------------------------------------------------------------------------- shaping
def entropy_shaped_advantages(adv: Tensor, entropy: Tensor, shape_mask: Tensor, mask: Tensor,
                              coef: float) -> Tensor:
    """TAO-RL entropy shaping of the advantage on the turn right after a tool result.

    ``A'_t = A_t * (1 + coef * z_t)`` where ``shape_mask_t`` is True, ``A'_t = A_t`` elsewhere, with
    ``z_t = (H_t - mean(H)) / (std(H) + 1e-6)``; the mean and (population) std run over the tokens where
    ``mask`` is True (the micro-batch's trainable tokens). ``H`` is detached: no gradient flows into it.
    If ``mask`` selects no token, ``z = 0``. ``coef == 0`` returns ``adv`` itself.

    Args:
        adv: (B, T) per-token advantages.
        entropy: (B, T) token entropies (see :func:`token_entropy`).
        shape_mask: (B, T) bool, tokens to shape.
        mask: (B, T) bool or 0/1, tokens whose entropy sets the statistics.
        coef: shaping strength.

    Returns:
        (B, T) shaped advantages.
    """
    if coef == 0:
        return adv
    if not (adv.shape == entropy.shape == shape_mask.shape == mask.shape):
        raise ValueError(f"adv, entropy, shape_mask and mask must share a shape; got {tuple(adv.shape)}, "
                         f"{tuple(entropy.shape)}, {tuple(shape_mask.shape)}, {tuple(mask.shape)}")
    h = entropy.detach()  # (B, T)
    m = _as_bool(mask)  # (B, T)
    n = m.sum().clamp(min=1).to(h.dtype)  # ()
    hm = torch.where(m, h, torch.zeros_like(h))  # (B, T)
    mean = hm.sum() / n  # ()
    dev = torch.where(m, h - mean, torch.zeros_like(h))  # (B, T)
    std = torch.sqrt((dev * dev).sum() / n)  # () population
    z = (h - mean) / (std + 1e-6)  # (B, T)
    z = torch.where(torch.isfinite(z), z, torch.zeros_like(z))  # (B, T): garbage outside mask stays out
    factor = (1.0 + coef * z).to(adv.dtype)  # (B, T)
    return torch.where(_as_bool(shape_mask), adv * factor, adv)  # (B, T)


# ---------------------------------------------------------------------------------------------- loss
def shift_measure(train_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Tensor:
    """How far an intervened trajectory is from what the policy would do, one value per sequence.

    ``shift_b = mean_t (behaviour_logp - train_logp)`` over the masked tokens of row ``b``: the mean log-ratio
    between the context the tokens were sampled in (with guidance) and the training context (without it),
    under the same weights. 0 for a row with no masked token. Large values mean the guidance made these
    tokens far likelier than the policy alone would; the shift filter drops rows above a threshold.

    Args:
        train_logp: (B, T) log-probs of the tokens in the training context.
        behaviour_logp: (B, T) log-probs recorded when they were sampled.
        mask: (B, T) the tokens that were sampled under guidance.

    Returns:
        (B,) mean log-ratio per row.
    """
    m = _as_bool(mask)  # (B, T)
    diff = torch.where(m, behaviour_logp - train_logp, torch.zeros_like(train_logp))  # (B, T)
    n = m.sum(dim=-1)  # (B,)
    return torch.where(n > 0, diff.sum(dim=-1) / n.clamp(min=1), torch.zeros_like(diff[:, 0]))  # (B,)


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float,
                  aggregation: str, max_tokens: int | None = None, ref_logp: Tensor | None = None,
                  kl_coef: float = 0.0, offpolicy_mask: Tensor | None = None,
                  shaping_gamma: float = 0.0, guided_sft: float = 0.0,
                  sft_mask: Tensor | None = None,
                  is_weight: Tensor | None = None,
                  clip_ratio_c: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with clip-higher, optional dual clip and an optional k3 KL penalty.

    ``rho_t = exp(clamp(logp_t - old_logp_t, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))``
    ``l_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)``   (PPO, Schulman et al. 2017;
    asymmetric bounds = clip-higher, DAPO, Yu et al. 2025)
    ``l_t = min(l_t, -c A_t)`` where ``A_t < 0``, when ``clip_ratio_c = c > 1``   (dual clip, Ye et al. 2020;
    ``c = 0``: off)
    ``l_t += kl_coef * k3(logp_t, ref_logp_t)``   when ``ref_logp`` is given and ``kl_coef > 0`` (GRPO)
    ``loss = aggregate(l, mask, aggregation, max_tokens)``

    With ``shaping_gamma > 0``, tokens in ``offpolicy_mask`` (sampled under guidance) use LUFFY's policy
    shaping instead: ``l_t = -f(pi_t) A_t`` with ``f(pi) = pi / (pi + gamma)``, ``pi_t = exp(logp_t)``, no
    clipping; it keeps the gradient of low-probability guided tokens from vanishing.

    With ``guided_sft = beta > 0``, tokens in ``sft_mask`` (the learner passes ``offpolicy_mask``: sampled under
    guidance the training context strips) of a trajectory that did better than its group (``A > 0``) also get
    a supervised term, ``l_t += -beta log pi_t``: STaR's rationalization (Zelikman et al. 2022) -- a success
    found with the guidance is fine-tuned on in the context without it, at full weight whatever its probability
    there (the shaped or clipped term's gradient on a token the stripped context finds unlikely is a fraction of
    that). Such a token is a sample of the guided policy, so this is a one-sample estimate of the forward KL
    from the guided to the unguided policy on successes: context distillation of what the guidance revealed.

    With ``is_weight`` (B, T) (``learner.old_logprobs = "recompute"``: the truncated importance-sampling weight
    ``min(pi_learner / pi_engine, C)`` of each sampled token, TRL's ``vllm_importance_sampling_correction``), the
    policy-gradient term is multiplied by it: ``l_t = w_t * l_t`` (before the SFT and KL terms, as in TRL).

    ``old_logp`` and ``ref_logp`` are treated as constants (detached). The gradient flows through ``logp``
    only; a token whose clipped branch binds has zero policy-gradient.

    Stats (python floats, no grad, over masked tokens; 0 when there are none):

    * ``clip_frac``: share of tokens where the clipped branch is taken, ``clip_frac_low + clip_frac_high``;
    * ``clip_frac_high``: ``A > 0`` and ``rho > 1 + eps_high``;
    * ``clip_frac_low``: ``A < 0`` and ``rho < 1 - eps_low``;
    * ``clip_frac_dual``: ``A < 0`` and the dual clip binds (``rho > c``; 0 when it is off);
    * ``ratio_mean``, ``ratio_max``: of ``rho``;
    * ``kl``: token mean of k3 (0 without a reference);
    * ``pg_loss``: the policy-gradient part alone, aggregated like the loss.

    Args:
        logp: (B, T) log-probabilities under the current policy (with grad).
        old_logp: (B, T) log-probabilities under the behaviour policy that sampled the tokens.
        adv: (B, T) advantages.
        mask: (B, T) bool or 0/1, trainable tokens.
        eps_low, eps_high: the ratio is clipped to ``[1 - eps_low, 1 + eps_high]``.
        aggregation: see :func:`aggregate`.
        max_tokens: for ``aggregation="dr_grpo"``.
        ref_logp: (B, T) reference-model log-probabilities, or None.
        kl_coef: weight of the k3 penalty.
        clip_ratio_c: the dual clip's ``c`` (> 1), or 0 for none.

    Returns:
        (loss, stats): a 0-dim tensor and a dict of floats.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid values: {', '.join(AGGREGATIONS)}")
    if not (logp.shape == old_logp.shape == adv.shape == mask.shape):
        raise ValueError(f"logp, old_logp, adv and mask must share a shape; got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(adv.shape)}, {tuple(mask.shape)}")
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0; got {eps_low}, {eps_high}")
    if clip_ratio_c != 0 and not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c must be > 1 (or 0: no dual clip); got {clip_ratio_c}")
    sampled = _as_bool(mask)  # (B, T): tokens with a behaviour log-prob
    m = sampled  # (B, T): every trained token
    zeros = torch.zeros_like(logp)  # (B, T)
    adv = adv.to(logp.dtype)
    log_ratio = torch.where(sampled, logp - old_logp.detach().to(logp.dtype), zeros)  # (B, T)
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T); exp stays finite in float32
    ratio = torch.exp(log_ratio)  # (B, T); exactly 1 outside the mask
    surr = ratio * adv  # (B, T)
    surr_clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv  # (B, T)
    pg = -torch.minimum(surr, surr_clipped)  # (B, T)
    dual = None
    if clip_ratio_c > 0:  # A < 0: the loss of a token is at most c |A| however far its ratio went
        cap = -clip_ratio_c * adv  # (B, T)
        dual = (adv < 0) & (pg > cap)  # (B, T)
        pg = torch.where(dual, cap, pg)  # (B, T)
    shaped = None
    if shaping_gamma > 0 and offpolicy_mask is not None:
        if offpolicy_mask.shape != logp.shape:
            raise ValueError(f"offpolicy_mask must be (B, T) like logp; got {tuple(offpolicy_mask.shape)}")
        shaped = m & _as_bool(offpolicy_mask)  # (B, T)
        pi = torch.exp(torch.where(shaped, logp, zeros))  # (B, T)
        pg = torch.where(shaped, -(pi / (pi + shaping_gamma)) * adv, pg)  # (B, T)
    if is_weight is not None:
        if is_weight.shape != logp.shape:
            raise ValueError(f"is_weight must be (B, T) like logp; got {tuple(is_weight.shape)}")
        pg = pg * is_weight.detach().to(logp.dtype)  # (B, T)
    per_token = pg  # (B, T)
    sft = None
    if guided_sft < 0:
        raise ValueError(f"guided_sft must be >= 0; got {guided_sft}")
    if guided_sft > 0 and sft_mask is not None:
        if sft_mask.shape != logp.shape:
            raise ValueError(f"sft_mask must be (B, T) like logp; got {tuple(sft_mask.shape)}")
        sft = sampled & _as_bool(sft_mask) & (adv > 0)  # (B, T)
        per_token = per_token - guided_sft * torch.where(sft, logp, zeros)  # (B, T)

    use_kl = ref_logp is not None
    if use_kl:
        if ref_logp.shape != logp.shape:
            raise ValueError(f"ref_logp must be (B, T) like logp; got {tuple(ref_logp.shape)}")
        ref = torch.where(m, ref_logp.detach().to(logp.dtype), logp.detach())  # (B, T): k3 = 0 off-mask
        kl = k3_kl(logp, ref)  # (B, T)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl

    loss = aggregate(per_token, m, aggregation, max_tokens)

    with torch.no_grad():
        n = int(m.sum())
        denom = float(max(n, 1))
        clipped = m if shaped is None else m & ~shaped  # shaped tokens are never clipped
        high = clipped & (adv > 0) & (ratio > 1.0 + eps_high)  # (B, T)
        low = clipped & (adv < 0) & (ratio < 1.0 - eps_low)  # (B, T)
        clip_high = float(high.sum()) / denom
        clip_low = float(low.sum()) / denom
        stats = {
            "clip_frac": clip_high + clip_low,
            "clip_frac_low": clip_low,
            "clip_frac_high": clip_high,
            "clip_frac_dual": float((dual & clipped).sum()) / denom if dual is not None else 0.0,
            "ratio_mean": float(ratio[m].sum()) / denom if n else 0.0,
            "ratio_max": float(ratio[m].max()) if n else 0.0,
            "kl": float(kl[m].sum()) / denom if (use_kl and n) else 0.0,
            "pg_loss": float(aggregate(pg, m, aggregation, max_tokens)),
            "sft_tokens": float(sft.sum()) if sft is not None else 0.0,
        }
    return loss, stats
