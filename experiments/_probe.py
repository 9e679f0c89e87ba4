"""What the probe scripts share: their common flags and the warm-started policy with its engine (not a script)."""

from __future__ import annotations

import argparse

import torch

from policy.engine import SamplingParams, TransformersEngine
from policy.tokenizer import ChatRenderer
from rail.config import build_config, parse_set
from rail.envs import make_env
from rail.policy_setup import make_policy


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="a config field, as in rail train --set")


#: Plain GRPO's treatment of intervened rollouts (the clipped ratio on the stripped context alone: no
#: rationalization, guided replay, shaping or rehearsal), which the probes measure treatments against.
PLAIN_LEARNER = {"learner": {"guided_sft": 0.0, "guided_replay": False, "shaping_gamma": 0.0, "rehearsal": 0.0}}


def setup(a: argparse.Namespace):
    """``(cfg, envs, model, renderer, engine, params, info)`` for the default preset with plain GRPO's learner
    (:data:`PLAIN_LEARNER`) and ``a.sets`` applied (tracking off): the cached warm start of that config, or a newly
    trained one."""
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = build_config("default", sets=[PLAIN_LEARNER, {"tracking": {"uri": ""}}] + [parse_set(s) for s in a.sets])
    envs = {f: make_env(f, cfg.env.seed) for f in cfg.env.families}
    model, tok, info = make_policy(cfg, envs)
    renderer = ChatRenderer(tok)
    engine = TransformersEngine(model, renderer, batch_size=cfg.rollout.batch_size)
    params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_tokens_per_turn,
                            cfg.rollout.max_turns)
    return cfg, envs, model, renderer, engine, params, info
