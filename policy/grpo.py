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

from dataclasses import dataclass

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
def aggregation_count(mask: Tensor, mode: str) -> float:
    """What :func:`aggregate` divides a batch's summed values by, up to a constant: its trained tokens
    (``token_mean``), its sequences with a trained token (``seq_mean``) or its rows (``dr_grpo``). A batch split into
    parts ``k`` has ``aggregate(all) = sum_k aggregate(part_k) * count_k / sum_j count_j``: the weights that make a
    minibatch trained in several forward passes (gradient accumulation) equal to one pass.

    Args:
        mask: (B, T) bool or 0/1.
        mode: one of ``"token_mean"``, ``"seq_mean"``, ``"dr_grpo"``.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid values: {', '.join(AGGREGATIONS)}")
    m = _as_bool(mask)  # (B, T)
    if mode == "token_mean":
        return float(m.sum())
    if mode == "seq_mean":
        return float((m.sum(dim=1) > 0).sum())
    return float(m.shape[0])


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


# ---------------------------------------------------------------------------------------------- policy loss
# One function per term, each checkable against its paper on its own; :func:`policy_loss` composes them in one
# place, in this order (the order matters: dual clip caps the clipped term, shaping replaces it on guided
# tokens, the IS weight scales what is left, then the SFT and KL terms are added).


def ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """The importance ratio of every sampled token, ``rho_t = exp(clamp(logp_t - old_logp_t, -C, C))`` with
    ``C = LOG_RATIO_CLAMP`` (verl's ``compute_policy_loss``); exactly 1 outside ``mask``. ``old_logp`` is a
    constant (detached).

    Args:
        logp: (B, T) log-probabilities under the current policy (with grad).
        old_logp: (B, T) log-probabilities under the behaviour policy that sampled the tokens.
        mask: (B, T) bool or 0/1, the sampled tokens.

    Returns:
        (B, T) ratios.
    """
    log_ratio = torch.where(_as_bool(mask), logp - old_logp.detach().to(logp.dtype), torch.zeros_like(logp))
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T); exp finite in float32


def clipped_surrogate(rho: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's clipped surrogate as a per-token loss (Schulman et al. 2017), with clip-higher's asymmetric bounds
    (DAPO, Yu et al. 2025): ``l_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)``. A token whose
    clipped branch binds has zero gradient.

    Args:
        rho: (B, T) ratios (:func:`ratio`).
        adv: (B, T) advantages.

    Returns:
        (B, T) per-token losses.
    """
    return -torch.minimum(rho * adv, torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high) * adv)  # (B, T)


def dual_clip(pg: Tensor, adv: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """Dual-clip PPO (Ye et al. 2020; verl's ``clip_ratio_c``): where ``A_t < 0`` the loss is capped at
    ``-c A_t = c |A_t|``, so one token whose ratio exploded cannot dominate the update.

    Args:
        pg: (B, T) per-token losses (:func:`clipped_surrogate`).
        adv: (B, T) advantages.
        c: the cap, > 1.

    Returns:
        (B, T) capped losses, and (B, T) bool where the cap binds.
    """
    cap = -c * adv  # (B, T)
    binds = (adv < 0) & (pg > cap)  # (B, T)
    return torch.where(binds, cap, pg), binds


def luffy_shaping(logp: Tensor, adv: Tensor, gamma: float) -> Tensor:
    """LUFFY's policy shaping for off-policy (guided) tokens (Yan et al. 2025), as a per-token loss without
    clipping: ``l_t = -f(pi_t) A_t`` with ``f(pi) = pi / (pi + gamma)`` and ``pi_t = exp(logp_t)``; it keeps the
    gradient of a guided token the policy finds unlikely from vanishing.

    Args:
        logp: (B, T) log-probabilities (with grad); only the positions the caller selects are meaningful.
        adv: (B, T) advantages.
        gamma: > 0.

    Returns:
        (B, T) per-token losses.
    """
    pi = torch.exp(logp)  # (B, T)
    return -(pi / (pi + gamma)) * adv  # (B, T)


def rationalization(logp: Tensor, adv: Tensor, guided: Tensor) -> tuple[Tensor, Tensor]:
    """STaR's rationalization (Zelikman et al. 2022) as a per-token loss: ``l_t = -log pi_t`` on the guided tokens
    (sampled under guidance the training context strips) of a rollout that did better than its group
    (``A_t > 0``), 0 elsewhere. A success found with the guidance is fine-tuned on in the context without it at
    full weight: a one-sample estimate of the forward KL from the guided to the unguided policy on successes.

    Args:
        logp: (B, T) log-probabilities in the training (stripped) context (with grad).
        adv: (B, T) advantages.
        guided: (B, T) bool, the sampled tokens that were sampled under guidance.

    Returns:
        (B, T) per-token losses, and (B, T) bool, the tokens it applies to.
    """
    on = guided & (adv > 0)  # (B, T)
    return -torch.where(on, logp, torch.zeros_like(logp)), on


def loss_stats(rho: Tensor, adv: Tensor, mask: Tensor, pg: Tensor, eps_low: float, eps_high: float,
               aggregation: str, max_tokens: int | None, shaped: Tensor | None, dual: Tensor | None,
               kl: Tensor | None, sft: Tensor | None) -> dict[str, float]:
    """The loss's diagnostics over the trained tokens ``mask`` (python floats, no grad; 0 when there are none):

    * ``clip_frac``: share of tokens where the clipped branch is taken, ``clip_frac_low + clip_frac_high``
      (shaped tokens are never clipped);
    * ``clip_frac_high``: ``A > 0`` and ``rho > 1 + eps_high``; ``clip_frac_low``: ``A < 0`` and ``rho < 1 - eps_low``;
    * ``clip_frac_dual``: the dual clip binds (0 when it is off);
    * ``ratio_mean``, ``ratio_max``: of ``rho``; ``kl``: token mean of k3 (0 without a reference);
    * ``pg_loss``: the policy-gradient part alone, aggregated like the loss; ``sft_tokens``: tokens rationalized.
    """
    with torch.no_grad():
        n = int(mask.sum())
        denom = float(max(n, 1))
        clipped = mask if shaped is None else mask & ~shaped
        high = clipped & (adv > 0) & (rho > 1.0 + eps_high)  # (B, T)
        low = clipped & (adv < 0) & (rho < 1.0 - eps_low)  # (B, T)
        clip_high = float(high.sum()) / denom
        clip_low = float(low.sum()) / denom
        return {
            "clip_frac": clip_high + clip_low,
            "clip_frac_low": clip_low,
            "clip_frac_high": clip_high,
            "clip_frac_dual": float((dual & clipped).sum()) / denom if dual is not None else 0.0,
            "ratio_mean": float(rho[mask].sum()) / denom if n else 0.0,
            "ratio_max": float(rho[mask].max()) if n else 0.0,
            "kl": float(kl[mask].sum()) / denom if (kl is not None and n) else 0.0,
            "pg_loss": float(aggregate(pg, mask, aggregation, max_tokens)),
            "sft_tokens": float(sft.sum()) if sft is not None else 0.0,
        }


@dataclass(frozen=True)
class LossSettings:
    """The scalars of :func:`policy_loss` (the learner's ``[learner]`` fields of the same names)."""

    eps_low: float = 0.2  # the ratio is clipped to [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.2
    aggregation: str = "token_mean"  # see :func:`aggregate`
    max_tokens: int | None = None  # for aggregation = "dr_grpo"
    clip_ratio_c: float = 0.0  # dual clip's c (> 1), 0: off
    shaping_gamma: float = 0.0  # LUFFY's gamma on guided tokens, 0: off (the clipped ratio)
    guided_sft: float = 0.0  # rationalization's weight beta, 0: off
    kl_coef: float = 0.0  # weight of the k3 penalty (with a reference)

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; valid values: {', '.join(AGGREGATIONS)}")
        if self.eps_low < 0 or self.eps_high < 0:
            raise ValueError(f"eps_low and eps_high must be >= 0; got {self.eps_low}, {self.eps_high}")
        if self.clip_ratio_c != 0 and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 (or 0: no dual clip); got {self.clip_ratio_c}")
        if self.guided_sft < 0:
            raise ValueError(f"guided_sft must be >= 0; got {self.guided_sft}")


def policy_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg: LossSettings, *,
                guided: Tensor | None = None, ref_logp: Tensor | None = None,
                is_weight: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The learner's loss, composed of the terms above, per trained token ``t`` (``mask``):

    1. ``l_t = clipped_surrogate(rho_t, A_t)`` with ``rho = ratio(logp, old_logp)``;
    2. ``l_t = dual_clip(l_t, A_t, c)`` when ``cfg.clip_ratio_c = c > 1``;
    3. on guided tokens (``guided``, sampled under guidance the training context strips), with
       ``cfg.shaping_gamma > 0``: ``l_t = luffy_shaping(logp_t, A_t)`` instead (no clipping);
    4. ``l_t = w_t l_t`` with ``is_weight`` (the truncated importance-sampling weight of ``learner.old_logprobs =
       "recompute"``, TRL's ``vllm_importance_sampling_correction``; before the SFT and KL terms, as in TRL);
    5. ``l_t += beta * rationalization(logp_t, A_t)`` on guided tokens, ``beta = cfg.guided_sft > 0``;
    6. ``l_t += kl_coef * k3_kl(logp_t, ref_logp_t)`` with ``ref_logp`` and ``cfg.kl_coef > 0`` (GRPO);

    then ``loss = aggregate(l, mask, cfg.aggregation, cfg.max_tokens)``. ``old_logp``, ``ref_logp`` and
    ``is_weight`` are constants (detached); the gradient flows through ``logp`` only.

    Args:
        logp: (B, T) log-probabilities under the current policy (with grad).
        old_logp: (B, T) behaviour log-probabilities.
        adv: (B, T) advantages.
        mask: (B, T) bool or 0/1, trainable tokens.
        guided: (B, T) bool or 0/1, or None.
        ref_logp: (B, T) reference-model log-probabilities, or None.
        is_weight: (B, T) importance-sampling weights, or None.

    Returns:
        (loss, stats): a 0-dim tensor and :func:`loss_stats`.
    """
    if not (logp.shape == old_logp.shape == adv.shape == mask.shape):
        raise ValueError(f"logp, old_logp, adv and mask must share a shape; got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(adv.shape)}, {tuple(mask.shape)}")
    for name, t in (("guided", guided), ("ref_logp", ref_logp), ("is_weight", is_weight)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} must be (B, T) like logp; got {tuple(t.shape)}")
    m = _as_bool(mask)  # (B, T): every trained token
    adv = adv.to(logp.dtype)
    rho = ratio(logp, old_logp, m)  # (B, T)
    pg = clipped_surrogate(rho, adv, cfg.eps_low, cfg.eps_high)  # (B, T)
    dual = None
    if cfg.clip_ratio_c > 0:
        pg, dual = dual_clip(pg, adv, cfg.clip_ratio_c)
    shaped = None
    if cfg.shaping_gamma > 0 and guided is not None:
        shaped = m & _as_bool(guided)  # (B, T)
        pg = torch.where(shaped, luffy_shaping(torch.where(shaped, logp, torch.zeros_like(logp)), adv,
                                               cfg.shaping_gamma), pg)  # (B, T)
    if is_weight is not None:
        pg = pg * is_weight.detach().to(logp.dtype)  # (B, T)
    per_token = pg  # (B, T)
    sft = None
    if cfg.guided_sft > 0 and guided is not None:
        term, sft = rationalization(logp, adv, m & _as_bool(guided))
        per_token = per_token + cfg.guided_sft * term  # (B, T)
    kl = None
    if ref_logp is not None:
        ref = torch.where(m, ref_logp.detach().to(logp.dtype), logp.detach())  # (B, T): k3 = 0 off-mask
        kl = k3_kl(logp, ref)  # (B, T)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    loss = aggregate(per_token, m, cfg.aggregation, cfg.max_tokens)
    return loss, loss_stats(rho, adv, m, pg, cfg.eps_low, cfg.eps_high, cfg.aggregation, cfg.max_tokens, shaped,
                            dual, kl, sft)
