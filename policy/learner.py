"""The GRPO learner: advantages and filters over a step's groups, then clipped policy-gradient epochs.

Algorithm-blind below ``prepare``: it trains on flat :class:`~policy.records.Trajectory` records whose
guidance has been stripped (``Trajectory.training_view``). Departures from the papers are listed in
``docs/algorithms.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from policy import grpo
from policy.packing import forward_logits, token_logprobs
from policy.records import Origin, Status, Trajectory, zero_variance
from policy.settings import COMPOSITIONS, OLD_LOGPROBS, LearnerSettings  # noqa: F401 - re-exported


@dataclass
class PreparedBatch:
    trajectories: list[Trajectory]
    advantages: list[float]
    stats: dict[str, float]


def pad_training_views(trajs: list[Trajectory], pad_id: int, device: torch.device | str | None = None):
    """Right-padded training views (B, L): ids, attention mask, loss mask, behaviour log-probs, post-tool flags,
    off-policy flags (policy tokens sampled under guidance the view strips), injected flags (tokens an
    intervention wrote as the policy's turn), on ``device`` (default the CPU). :func:`is_weight_view` gives the
    importance-sampling weights."""
    views = [t.training_view() for t in trajs]
    B, L = len(views), max(len(v[0]) for v in views)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L))
    old = torch.zeros((B, L))
    post_tool = torch.zeros((B, L), dtype=torch.bool)
    offpolicy = torch.zeros((B, L), dtype=torch.bool)
    injected = torch.zeros((B, L), dtype=torch.bool)
    for b, ((i, m, lp, turn, origin), tr) in enumerate(zip(views, trajs)):
        n = len(i)
        ids[b, :n], attn[b, :n] = torch.tensor(i), 1
        mask[b, :n], old[b, :n] = torch.tensor(m, dtype=torch.float), torch.tensor(lp)
        post_tool[b, :n] = torch.tensor([t >= 1 for t in turn])
        offpolicy[b, :n] = torch.tensor(tr.offpolicy_flags(), dtype=torch.bool)
        injected[b, :n] = torch.tensor([o == Origin.INJECTED for o in origin])
    out = ids, attn, mask, old, post_tool, offpolicy, injected
    return out if device is None else tuple(t.to(device) for t in out)


def is_weight_view(trajs: list[Trajectory]) -> torch.Tensor:
    """(B, L) right-padded importance-sampling weights aligned with :func:`pad_training_views` (1 elsewhere)."""
    views = [t.training_is_weights() for t in trajs]
    out = torch.ones((len(views), max(len(v) for v in views)))
    for b, v in enumerate(views):
        out[b, :len(v)] = torch.tensor(v)
    return out


def micro_batches(trajs: list[Trajectory], tokens_per_pass: int) -> list[list[int]]:
    """Indices of ``trajs`` split, in order, into forward passes of at most ``tokens_per_pass`` padded tokens (rows x
    the longest row's context; a trajectory longer than that gets a pass of its own). ``0``: one pass of all."""
    if not trajs:
        return []
    if tokens_per_pass <= 0:
        return [list(range(len(trajs)))]
    out, cur, longest = [], [], 0
    for i, t in enumerate(trajs):
        n = len(t.context_prompt_ids) + len(t.ids)  # the training view's length, at most
        if cur and (len(cur) + 1) * max(longest, n) > tokens_per_pass:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    out.append(cur)
    return out


def _nll_sum(model, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, pad_id: int, chunk: int) -> torch.Tensor:
    """The summed negative log-likelihood of the tokens ``mask`` marks, of one padded batch (:func:`pad_training_views`)."""
    if chunk:
        logp, _ = token_logprobs(model, ids, attn, pad_id, 0.0, chunk)  # (B, T)
    else:
        logits = forward_logits(model, ids, attn, pad_id)[:, :-1].float()  # (B, T, V), packed
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T)
    return -(logp * mask[:, 1:]).sum()


def sft_loss(model, trajs: list[Trajectory], pad_id: int, chunk: int = 0) -> torch.Tensor:
    """Mean negative log-likelihood of the trained tokens of ``trajs`` (their training views), in one forward pass.
    ``chunk``: the vocabulary projection that many positions at a time (:func:`policy.packing.token_logprobs`).
    :func:`sft_backward` is the same loss in passes of bounded size."""
    ids, attn, mask, *_ = pad_training_views(trajs, pad_id, next(model.parameters()).device)
    return _nll_sum(model, ids, attn, mask, pad_id, chunk) / mask[:, 1:].sum().clamp(min=1)


def sft_backward(model, trajs: list[Trajectory], pad_id: int, chunk: int = 0, tokens_per_pass: int = 0,
                 weight: float = 1.0) -> float:
    """Add to the parameters' ``.grad`` the gradient of ``weight`` x :func:`sft_loss` of ``trajs``, computed in
    passes of at most ``tokens_per_pass`` tokens (:func:`micro_batches`): each pass's summed NLL is divided by the
    trained tokens of all of ``trajs``, so the gradient is one pass's, with one pass's memory. Returns the loss
    (the mean NLL)."""
    device = next(model.parameters()).device
    parts = [pad_training_views([trajs[i] for i in p], pad_id, device)[:3]
             for p in micro_batches(trajs, tokens_per_pass)]
    total = max(1.0, float(sum(m[:, 1:].sum() for _, _, m in parts)))
    nll = 0.0
    for ids, attn, mask in parts:
        part = _nll_sum(model, ids, attn, mask, pad_id, chunk) / total
        (weight * part).backward()
        nll += float(part.detach())
    return nll


@torch.no_grad()
def shift_measures(model, trajs: list[Trajectory], pad_id: int, temperature: float, batch_size: int,
                   chunk: int = 0) -> list[float]:
    """The shift measure (:func:`policy.grpo.shift_measure`) of each trajectory under ``model``'s current weights,
    logits divided by the rollout ``temperature`` as the behaviour's were: what the shift filter compares with
    ``shift_threshold``. The learner's filter and another trainer's adapter (``rail.integrations.trl``) both call it."""
    out: list[float] = []
    was = model.training
    model.eval()
    try:
        for i in range(0, len(trajs), batch_size):
            part = trajs[i : i + batch_size]
            ids, attn, _, old, _, off, _ = pad_training_views(part, pad_id, next(model.parameters()).device)
            logp, _ = token_logprobs(model, ids, attn, pad_id, temperature, chunk)  # (B, T)
            out += grpo.shift_measure(logp, old[:, 1:], off[:, 1:]).tolist()
    finally:
        model.train(was)
    return out


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (i - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - frac
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        raise ValueError(f"learner.schedule: unknown '{schedule}' (constant, linear, cosine)")

    return f


def assign_status(trajs: list[Trajectory], compose: str = "mix", *,
                  shift_of: Callable[[list[Trajectory]], list[float]] | None = None,
                  shift_threshold: float = float("inf"), drop_zero_variance: bool = True,
                  mask_all_tools_failed: bool = True) -> tuple[list[Trajectory], dict[str, float]]:
    """The learner's filters: the one rule that sets every rollout's :class:`~policy.records.Status` (and
    ``shift``), for rail's learner and for every adapter whose trainer computes its own loss. In order:

    1. probe rollouts (``intervention["probe"]``) are never trained (``probe``);
    2. group composition: ``mix`` keeps intervened trajectories in their task's group beside the base ones
       (LUFFY); ``replace`` drops the base rollouts of every group that has intervened ones (ActGuide,
       ``replaced``);
    3. the shift filter: a trajectory sampled under guidance that training strips whose shift measure
       (``shift_of``, e.g. :func:`shift_measures` under the current weights) exceeds ``shift_threshold`` (NaN
       counts as over) is dropped (``shift_rejected``); without ``shift_of`` nothing is measured;
    4. over what is left of each group: a group without a reward spread (:func:`policy.records.zero_variance`)
       carries no advantage
       (``zero_variance`` with ``drop_zero_variance``), and a rollout whose every tool call failed is masked
       (``all_tools_failed`` with ``mask_all_tools_failed``, TAO-RL); the rest are ``trained``.

    Returns the rollouts that joined their groups (what advantages are computed over) and the filters' counts.
    """
    if compose not in COMPOSITIONS:
        raise ValueError(f"unknown group composition {compose!r}; one of {', '.join(COMPOSITIONS)}")
    stats = {"groups": 0.0, "zero_variance_groups": 0.0, "zero_variance_share": 0.0, "all_tools_failed": 0.0,
             "kept": 0.0, "probes": 0.0, "replaced": 0.0, "shift_measured": 0.0, "shift_rejected": 0.0,
             "shift_accepted": 0.0, "shift_mean": 0.0, "shift_max": 0.0}
    for t in trajs:
        t.status, t.shift = Status.UNSET, None
    pool = []
    for t in trajs:
        if t.intervention is not None and t.intervention.get("probe"):
            t.status = Status.PROBE
        else:
            pool.append(t)
    stats["probes"] = float(len(trajs) - len(pool))
    if compose == "replace":
        replaced = {t.group for t in pool if t.intervention is not None}
        for t in pool:
            if t.intervention is None and t.group in replaced:
                t.status = Status.REPLACED
        stats["replaced"] = float(sum(t.status == Status.REPLACED for t in pool))
        pool = [t for t in pool if t.status != Status.REPLACED]
    shifted = [t for t in pool if t.context_shifted] if shift_of is not None else []
    if shifted:
        values = shift_of(shifted)
        for t, v in zip(shifted, values):
            t.shift = v
            if not (v <= shift_threshold):  # NaN counts as over
                t.status = Status.SHIFT_REJECTED
        stats["shift_measured"] = float(len(shifted))
        stats["shift_rejected"] = float(sum(t.status == Status.SHIFT_REJECTED for t in shifted))
        stats["shift_accepted"] = stats["shift_measured"] - stats["shift_rejected"]
        finite = [v for v in values if math.isfinite(v)]
        stats["shift_mean"] = sum(finite) / len(finite) if finite else 0.0
        stats["shift_max"] = max(finite) if finite else 0.0
        pool = [t for t in pool if t.status != Status.SHIFT_REJECTED]
    if not pool:
        return pool, stats
    rewards: dict[int, list[float]] = {}
    for t in pool:
        rewards.setdefault(t.group, []).append(t.reward)
    flat = {g: zero_variance(rs) for g, rs in rewards.items()}
    all_failed = [(lambda c: c[0] > 0 and c[0] == c[1])(t.tool_calls()) for t in pool]
    for i, t in enumerate(pool):
        if drop_zero_variance and flat[t.group]:
            t.status = Status.ZERO_VARIANCE
        elif mask_all_tools_failed and all_failed[i]:
            t.status = Status.ALL_TOOLS_FAILED
        else:
            t.status = Status.TRAINED
    n_groups, zv_groups = len(flat), sum(flat.values())
    stats.update({"groups": float(n_groups), "zero_variance_groups": float(zv_groups),
                  "zero_variance_share": zv_groups / n_groups, "all_tools_failed": float(sum(all_failed)),
                  "kept": float(sum(t.status == Status.TRAINED for t in pool))})
    return pool, stats


class GRPOLearner:
    def __init__(self, model: torch.nn.Module, settings: LearnerSettings, total_steps: int, pad_id: int,
                 rehearsal_source: Callable[[int], list[Trajectory]] | None = None):
        """``total_steps``: the training steps (``update`` calls) the learning-rate schedule spans.
        ``rehearsal_source(n)``: ``n`` fresh demonstrations to rehearse (required when ``settings.rehearsal`` > 0)."""
        if settings.rehearsal > 0 and rehearsal_source is None:
            raise ValueError("learner rehearsal > 0 (the default is 1) needs a rehearsal_source (demonstrations to "
                             "rehearse); set rehearsal=0 to train without one")
        self.model = model
        self.rehearsal_source = rehearsal_source
        self.s = settings
        self.pad_id = pad_id
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.lr, weight_decay=settings.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(settings.schedule, settings.warmup_steps, total_steps))
        self.loss = grpo.LossSettings(eps_low=settings.eps_low, eps_high=settings.eps_high,
                                      aggregation=settings.loss_agg, max_tokens=settings.max_tokens,
                                      clip_ratio_c=settings.clip_ratio_c, shaping_gamma=settings.shaping_gamma,
                                      guided_sft=settings.guided_sft, kl_coef=settings.kl_coef)
        self.ref_model = None
        if settings.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.updates = 0

    # ------------------------------------------------------------------ advantages and filters
    def prepare(self, trajs: list[Trajectory], compose: str = "mix") -> PreparedBatch:
        """What will be trained on, and with which advantages: :func:`assign_status` (the filters, with this
        learner's settings and shift measure) sets every trajectory's ``status`` and ``shift``; group-relative
        advantages are computed over the rollouts that joined their groups, and the ``trained`` ones are kept
        (with ``guided_replay``, each trained guided rollout also in its guided context)."""
        tis = self.recompute_logprobs(trajs) if self.s.old_logprobs == "recompute" else {}
        s = self.s
        pool, stats = assign_status(trajs, compose, shift_of=self.shift_of, shift_threshold=s.shift_threshold,
                                    drop_zero_variance=s.drop_zero_variance,
                                    mask_all_tools_failed=s.mask_all_tools_failed)
        stats.update(tis)
        stats["guided_replay"] = 0.0
        if not pool:
            return PreparedBatch([], [], stats)
        rewards = torch.tensor([t.reward for t in pool], dtype=torch.float64)  # (N,)
        _, group_index = torch.unique(torch.tensor([t.group for t in pool]), return_inverse=True)  # (N,)
        adv = grpo.group_advantages(rewards, group_index, scale=s.adv_scale)  # (N,)
        idx = [i for i, t in enumerate(pool) if t.status == Status.TRAINED]
        kept, advs = [pool[i] for i in idx], [float(adv[i]) for i in idx]
        if s.guided_replay:  # the guided policy's own on-policy sample, same advantage, guidance kept
            replays = [(dataclasses.replace(t, keep_guidance=True, status=Status.GUIDED_REPLAY), a)
                       for t, a in zip(kept, advs) if t.context_shifted]
            kept += [r for r, _ in replays]
            advs += [a for _, a in replays]
            stats["guided_replay"] = float(len(replays))
        return PreparedBatch(kept, advs, stats)

    @torch.no_grad()
    def recompute_logprobs(self, trajs: list[Trajectory]) -> dict[str, float]:
        """``learner.old_logprobs = "recompute"``: replace each trajectory's behaviour log-probs by the learner's,
        in the context it was sampled in (guidance included), keeping the engine's in ``engine_logprobs``, and set
        the truncated importance-sampling weight ``min(exp(learner - engine), tis_cap)`` of every policy token
        (TRL's ``vllm_importance_sampling_correction``, token_truncate). Returns the ``tis/*`` statistics."""
        if self.s.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"unknown old_logprobs {self.s.old_logprobs!r}; one of {', '.join(OLD_LOGPROBS)}")
        ratios, diffs = [], []
        was = self.model.training
        self.model.eval()
        try:
            for i in range(0, len(trajs), self.s.minibatch_size):
                chunk = trajs[i : i + self.s.minibatch_size]
                sampled = [dataclasses.replace(t, keep_guidance=True) for t in chunk]  # the context as sampled
                ids, attn, mask, *_ = pad_training_views(sampled, self.pad_id, self.device)
                logp, _ = token_logprobs(self.model, ids, attn, self.pad_id, self.s.temperature,
                                         self.s.logprob_chunk)  # (B, T)
                for b, t in enumerate(chunk):
                    mine = logp[b][mask[b, 1:] > 0].tolist()  # the policy tokens, in order
                    pos = [k for k, o in enumerate(t.origin) if o == Origin.POLICY]
                    if t.engine_logprobs is None:
                        t.engine_logprobs = list(t.logprobs)
                    new, w = list(t.logprobs), [1.0] * len(t.ids)
                    for k, lp in zip(pos, mine):
                        r = math.exp(min(lp - t.engine_logprobs[k], 50.0))
                        new[k], w[k] = lp, min(r, self.s.tis_cap)
                        ratios.append(r), diffs.append(abs(lp - t.engine_logprobs[k]))
                    t.logprobs, t.is_weights = new, w
        finally:
            self.model.train(was)
        if not ratios:
            return {"tis_ratio_mean": 1.0, "tis_ratio_max": 1.0, "tis_truncated_share": 0.0, "tis_logprob_diff_max": 0.0}
        return {"tis_ratio_mean": sum(ratios) / len(ratios), "tis_ratio_max": max(ratios),
                "tis_truncated_share": sum(r > self.s.tis_cap for r in ratios) / len(ratios),
                "tis_logprob_diff_max": max(diffs)}

    def shift_of(self, trajs: list[Trajectory]) -> list[float]:
        """The shift measure of each trajectory under the current weights (no gradient)."""
        return shift_measures(self.model, trajs, self.pad_id, self.s.temperature, self.s.minibatch_size,
                              self.s.logprob_chunk)

    # ------------------------------------------------------------------ forward
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _batch(self, trajs: list[Trajectory], advs: list[float]):
        ids, attn, mask, old, post_tool, off, _ = pad_training_views(trajs, self.pad_id, self.device)
        B, L = ids.shape
        adv = torch.tensor(advs, dtype=torch.float, device=self.device)[:, None].expand(B, L - 1)  # (B, T)
        isw = is_weight_view(trajs)[:, 1:].to(self.device) if self.s.old_logprobs == "recompute" else None  # (B, T)
        # token k is predicted from position k-1: shift everything that describes targets by one
        return ids, attn, mask[:, 1:], old[:, 1:], post_tool[:, 1:] & (mask[:, 1:] > 0), adv, off[:, 1:], isw

    def minibatch_loss(self, trajs: list[Trajectory], advs: list[float]):
        """``(loss, stats, entropy (B, T), mask (B, T))``: the policy loss of one minibatch under the current weights
        (:func:`policy.grpo.policy_loss`, with entropy shaping and the KL reference when set), rehearsal apart,
        in one forward pass."""
        return self._loss(self._batch(trajs, advs))

    def _loss(self, batch):
        s = self.s
        ids, attn, mask, old, shape_mask, adv, off, isw = batch
        logp, ent = token_logprobs(self.model, ids, attn, self.pad_id, self.s.temperature, self.s.logprob_chunk,
                                   entropy=True)  # (B, T) each
        if s.entropy_coef:
            adv = grpo.entropy_shaped_advantages(adv, ent, shape_mask, mask, s.entropy_coef)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(self.ref_model, ids, attn, self.pad_id, self.s.temperature,
                                        self.s.logprob_chunk)
        loss, st = grpo.policy_loss(logp, old, adv, mask, self.loss, guided=off, ref_logp=ref, is_weight=isw)
        return loss, st, ent, mask

    def accumulate(self, trajs: list[Trajectory], advs: list[float]) -> tuple[float, dict[str, float]]:
        """Add to ``.grad`` the gradient of one minibatch's loss (:meth:`minibatch_loss`, plus rehearsal when set),
        in forward passes of at most ``learner.tokens_per_pass`` tokens (:func:`micro_batches`). Each pass's loss
        is weighted by its share of what the aggregation divides by (:func:`policy.grpo.aggregation_count`), so the
        gradient is that of one pass over the whole minibatch (entropy shaping apart: its statistics are the pass's).
        Returns the loss and the minibatch's statistics."""
        s = self.s
        parts = [self._batch([trajs[i] for i in p], [advs[i] for i in p])
                 for p in micro_batches(trajs, s.tokens_per_pass)]
        counts = [grpo.aggregation_count(b[2], self.loss.aggregation) for b in parts]  # b[2]: the trained tokens
        total = sum(counts)
        value, st, ent_sum, tokens = 0.0, {}, 0.0, 0.0
        for b, c in zip(parts, counts):
            part_loss, part_st, ent, mask = self._loss(b)
            w = c / total if total else 1.0 / len(parts)
            (part_loss * w).backward()
            value += float(part_loss.detach()) * w
            for k, v in part_st.items():
                st[k] = st.get(k, 0.0) + float(v) * w
            ent_sum, tokens = ent_sum + float((ent * mask).sum()), tokens + float(mask.sum())
        st["entropy"] = ent_sum / max(1.0, tokens)
        if s.rehearsal > 0:  # PPO-ptx: keep the demonstrations' likelihood up beside the RL objective
            nll = sft_backward(self.model, self.rehearsal_source(s.rehearsal_batch), self.pad_id, s.logprob_chunk,
                               s.tokens_per_pass, weight=s.rehearsal)
            value += s.rehearsal * nll
            st["rehearsal_nll"] = nll
        return value, st

    def update(self, batch: PreparedBatch, generator: torch.Generator) -> dict[str, float]:
        """``epochs`` passes of minibatch PPO-clip steps over the prepared trajectories."""
        s = self.s
        n = len(batch.trajectories)
        agg: dict[str, list[float]] = {}
        if n == 0:
            lr = float(self.scheduler.get_last_lr()[0])
            self._advance_schedule()  # the schedule runs on training steps, trained on or not
            return {"skipped": 1.0, "lr": lr}
        self.model.train()
        for _ in range(s.epochs):
            order = torch.randperm(n, generator=generator).tolist()
            for i in range(0, n, s.minibatch_size):
                sel = order[i : i + s.minibatch_size]
                self.optimizer.zero_grad(set_to_none=True)
                loss, st = self.accumulate([batch.trajectories[j] for j in sel], [batch.advantages[j] for j in sel])
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip if s.grad_clip > 0 else float("inf"))
                if not math.isfinite(loss) or not torch.isfinite(gn):
                    self.optimizer.zero_grad(set_to_none=True)  # never step on a NaN; count it instead
                    agg.setdefault("nonfinite_skipped", []).append(1.0)
                    continue
                self.optimizer.step()
                self.updates += 1
                st = dict(st, loss=loss, grad_norm=float(gn))
                for k, v in st.items():
                    agg.setdefault(k, []).append(float(v))
        out = {k: sum(v) / len(v) for k, v in agg.items() if k != "nonfinite_skipped"}
        out["nonfinite_skipped"] = float(len(agg.get("nonfinite_skipped", [])))
        out["lr"] = float(self.scheduler.get_last_lr()[0])  # the rate this step trained at
        self._advance_schedule()  # once per training step: how many minibatches survive the filters varies
        out["updates"] = float(self.updates)
        return out

    def _advance_schedule(self) -> None:
        with warnings.catch_warnings():  # a step on which nothing was trained yet is still a step of the schedule
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            self.scheduler.step()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates = int(state["updates"])
