"""The GRPO learner's settings (:class:`LearnerSettings`), without torch: ``rail``'s config tree reads its
``[learner]`` defaults from here, so each default is written once. ``policy.learner`` re-exports it.

The defaults are the recipe ``rail train`` runs (docs/configuration.md, "The learner's defaults"):
rationalization, guided replay, shaping and rehearsal on. Plain GRPO's learner is ``guided_sft=0,
guided_replay=False, shaping_gamma=0, rehearsal=0``; with ``rehearsal > 0`` the learner needs a rehearsal
source (:class:`policy.learner.GRPOLearner`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: How intervened rollouts join their group.
COMPOSITIONS = ("mix", "replace")
#: Where the PPO ratio's old (behaviour) log-probs come from.
OLD_LOGPROBS = ("engine", "recompute")


@dataclass(frozen=True)
class LearnerSettings:
    lr: float = 3e-4
    schedule: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 0
    weight_decay: float = 0.0
    epochs: int = 1
    minibatch_size: int = 64
    eps_low: float = 0.2
    eps_high: float = 0.28
    clip_ratio_c: float = 0.0  # dual clip for A < 0 (0: off)
    loss_agg: str = "token_mean"
    adv_scale: str = "std"
    kl_coef: float = 0.0
    grad_clip: float = 1.0
    drop_zero_variance: bool = True
    mask_all_tools_failed: bool = True
    entropy_coef: float = 0.0
    shift_threshold: float = 1.0  # drop intervened trajectories whose shift measure exceeds this (inf: no filter)
    shaping_gamma: float = 0.1  # LUFFY policy shaping on guided tokens (0: off, the ordinary clipped ratio)
    guided_sft: float = 1.0  # STaR rationalization: beta x stripped-context NLL of guided tokens, above-baseline rollouts
    guided_replay: bool = True  # also train each trained guided rollout in its guided context (on-policy there)
    rehearsal: float = 1.0  # PPO-ptx-style: lambda x the NLL of demonstrations from the rehearsal source, every minibatch
    rehearsal_batch: int = 16  # demonstrations per minibatch when rehearsal > 0
    old_logprobs: str = "engine"  # engine | recompute (the learner's own, with truncated IS by the engine's)
    tis_cap: float = 3.0  # truncated importance-sampling cap with old_logprobs = "recompute"
    temperature: float = 1.0  # logits are divided by the rollout temperature, as the behaviour's were
    max_tokens: int = 96  # Dr.GRPO's constant normaliser: the most tokens a rollout can generate
    logprob_chunk: int = 0  # 0: log-probs from the full logits; n: the vocabulary projection n positions at a time
    tokens_per_pass: int = 0  # 0: a minibatch in one forward pass; n: passes of at most n padded tokens (accumulated)
