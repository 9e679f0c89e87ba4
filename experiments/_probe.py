"""What the probe scripts share: their common flags, the warm-started policy with its engine, unguided groups of
rollouts and the rollouts of one intervention operator from them (not a script)."""

from __future__ import annotations

import argparse

import torch

from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
from policy.tokenizer import ChatRenderer
from rail import interventions as ivs
from rail.config import Config, build_config, parse_set
from rail.envs import make_env, rubric_status
from rail.policy_setup import make_policy


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="a config field, as in rail train --set")


#: Plain GRPO's treatment of intervened rollouts (the clipped ratio on the stripped context alone: no
#: rationalization, guided replay, shaping or rehearsal), which the probes measure treatments against.
PLAIN_LEARNER = {"learner": {"guided_sft": 0.0, "guided_replay": False, "shaping_gamma": 0.0, "rehearsal": 0.0}}


def probe_config(a: argparse.Namespace, sets: list[dict] | None = None) -> Config:
    """The default preset with plain GRPO's learner (:data:`PLAIN_LEARNER`), tracking off, then ``sets`` and
    ``a.sets`` (``--set``) applied; a bad value raises :class:`rail.config.ConfigError`."""
    return build_config("default", sets=[PLAIN_LEARNER, {"tracking": {"uri": ""}}, *(sets or []),
                                         *[parse_set(s) for s in a.sets]])


def setup(a: argparse.Namespace, cfg: Config | None = None):
    """``(cfg, envs, model, renderer, engine, params, info)`` for ``cfg`` (default :func:`probe_config`): the
    cached warm start of that config, or a newly trained one."""
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = probe_config(a) if cfg is None else cfg
    envs = {f: make_env(f, cfg.env.seed) for f in cfg.env.families}
    model, tok, info = make_policy(cfg, envs)
    renderer = ChatRenderer(tok)
    engine = TransformersEngine(model, renderer, batch_size=cfg.rollout.batch_size)
    params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_tokens_per_turn,
                            cfg.rollout.max_turns)
    return cfg, envs, model, renderer, engine, params, info


def operator_keys() -> list[str]:
    """Every ``how@where`` of :data:`rail.interventions.HOWS` x :data:`~rail.interventions.WHERES`, in that order
    (whether one can act on a group is :func:`rail.interventions.plan`'s to say)."""
    return [f"{how}@{where}" for how in ivs.HOWS for where in ivs.WHERES]


def rollout_groups(engine, params: SamplingParams, env, runner, tasks: list, per_task: int, seed: int) -> list[list]:
    """``per_task`` unguided rollouts of each of ``tasks``, scored (verifier reward and rubric status): one group
    per task, in the order of ``tasks`` (each trajectory's ``group`` is its task's index)."""
    reqs = [RolloutRequest(task=t, env=runner, system=env.system_prompt(), group=i)
            for i, t in enumerate(tasks) for _ in range(per_task)]
    trajs = engine.generate(reqs, params, seed=seed)
    for tr in trajs:
        task = tasks[tr.group]
        tr.reward, tr.rubric = env.reward(task, tr.steps), rubric_status(env, task, tr.steps)
    return [[tr for tr in trajs if tr.group == i] for i in range(len(tasks))]


def operator_rollouts(engine, params: SamplingParams, env, runner, tasks: list, groups: list[list], key: str,
                      how_many: int, max_tokens_per_turn: int, seed: int, only=None):
    """The rollouts of operator ``key`` (``how@where``, ``how_many`` rollouts per group) from the groups it can
    act on, those of indices ``only`` (default all): ``(requests, trajectories, rewards)``, empty when it can act
    on none of them. ``tasks[i]`` is group ``i``'s task."""
    iv = ivs.Intervention.parse(key, how_many)
    rq = []
    for i in (range(len(groups)) if only is None else only):
        p = ivs.plan(iv, i, groups[i], tasks[i], runner, env.system_prompt(), "rollouts", max_tokens_per_turn)
        if p is not None:
            rq += p.requests
    out = engine.generate(rq, params, seed=seed) if rq else []
    return rq, out, [env.reward(tasks[r.group], tr.steps) for r, tr in zip(rq, out)]
