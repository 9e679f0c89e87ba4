"""What a step's update would teach the unguided policy from some of its rollouts: the first-order change of the
log-likelihood of a skill's reference solutions that the update's part from those rollouts makes (TracIn, Pruthi
et al. 2020, "Estimating Training Data Influence by Tracing Gradient Descent", arXiv:2002.08145: a gradient step
of size ``eta`` on ``z`` changes the loss on ``z'`` by ``-eta grad L(z) . grad L(z')`` to first order).

The part of the update that comes from some rollouts is the learner's own loss on them (:meth:`GRPOLearner.
minibatch_loss`: their advantages, the clipped ratio of the context they are trained in, shaping, rationalization,
as the update computes it), weighted by their share of the step's trained tokens. The reference is the mean
log-likelihood of reference solutions in their unguided context. So a rescue whose tokens the learner barely
moves (the ratio of a hinted token in the stripped context clipped to nothing, say) or whose solution is not the
skill's counts for little, whatever learning signal it added to its group. First order, and of a plain gradient
step: the optimizer's preconditioning is left out.
"""

from __future__ import annotations

import torch

from policy.learner import sft_loss
from policy.records import Trajectory


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _flat(grads, params) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)])


def likelihood_gradient(model: torch.nn.Module, trajs: list[Trajectory], pad_id: int, chunk: int = 0) -> torch.Tensor:
    """The gradient of the mean log-likelihood of ``trajs``' trained tokens (training views: guidance stripped) with
    respect to the model's trainable parameters, flattened: (P,). Weights and ``.grad`` are left as they were."""
    params = _params(model)
    with torch.enable_grad():
        grads = torch.autograd.grad(-sft_loss(model, trajs, pad_id, chunk), params, allow_unused=True)
    return _flat(grads, params)  # (P,)


def update_influence(learner, reference: list[Trajectory], sets: list[list[tuple[Trajectory, float]]],
                     total_tokens: int) -> list[float | None]:
    """For each set of (trajectory, advantage), the first-order change of the mean log-likelihood of ``reference``
    that the update's part from that set makes: ``lr * (-grad L_set) . grad loglik(reference)``, ``L_set`` the
    learner's loss on the set times its share of the ``total_tokens`` trained this step; None for an empty set."""
    if not any(sets):
        return [None] * len(sets)
    model, params = learner.model, _params(learner.model)
    lr = float(learner.scheduler.get_last_lr()[0])
    was = model.training
    model.train()  # as the update runs it
    try:
        ref = likelihood_gradient(model, reference, learner.pad_id, learner.s.logprob_chunk)  # (P,)
        out: list[float | None] = []
        for s in sets:
            if not s:
                out.append(None)
                continue
            trajs, advs = [t for t, _ in s], [a for _, a in s]
            with torch.enable_grad():
                loss, _, _, mask = learner.minibatch_loss(trajs, advs)
                share = float(mask.sum()) / max(1, total_tokens)
                grads = torch.autograd.grad(loss * share, params, allow_unused=True)
            out.append(float(-lr * (_flat(grads, params) @ ref)))
    finally:
        model.train(was)
    return out
