# How much of what a hint reveals has a trained policy absorbed, short of solving the task? A success rate of 0
# says nothing about whether training moved the unguided policy towards the answer; this probe measures it.
# With the warm-started policy it samples hinted rollouts (default rubric_hint@violation) on the held-out tasks
# of one family and level, keeps the successful ones, and marks their *revealed* tokens: policy tokens sampled
# under the hint that the unguided context found unlikely (probability < 0.5 under the warm start). Then, for the
# warm start and every checkpoint given, it teacher-forces those same rollouts in the context without the hint
# and reports the mean probability of the revealed tokens, beside the checkpoint's unguided and hinted success.
# Run: .venv/bin/python experiments/probe_absorbed.py runs/a runs/b/checkpoints/step_000100 [--family kin --level 3]
"""Prints one JSON line per policy (the warm start first), then a summary line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from _probe import add_common_args, setup
from policy import grpo
from policy.engine import RolloutRequest, TransformersEngine
from policy.learner import pad_training_views
from policy.model import load_policy
from policy.records import succeeded
from policy.packing import forward_logits
from rail import interventions as ivs
from rail.envs import ToolRunner, rubric_status
from rail.train import resolve_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", type=Path, nargs="*", help="run directories or …/checkpoints/step_N")
    ap.add_argument("--family", default="kin")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--how", default="rubric_hint@violation", help="the intervention, how@where")
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--samples", type=int, default=4, help="base and hinted rollouts per task")
    add_common_args(ap)
    a = ap.parse_args()
    cfg, envs, model, renderer, engine, params, info = setup(a)
    env = envs[a.family]
    runner = ToolRunner(env)
    tasks = env.eval_tasks(a.level, a.tasks)
    iv = ivs.Intervention.parse(a.how, a.samples)

    def rollouts(eng, reqs, seed):
        trajs = eng.generate(reqs, params, seed=seed)
        for tr in trajs:
            task = tasks[tr.group]
            tr.reward, tr.rubric = env.reward(task, tr.steps), rubric_status(env, task, tr.steps)
        return trajs

    def successes(eng):
        """(unguided success, hinted success, the successful hinted rollouts) of one policy."""
        base = rollouts(eng, [RolloutRequest(task=t, env=runner, system=env.system_prompt(), group=i)
                              for i, t in enumerate(tasks) for _ in range(a.samples)], 1)
        reqs = []
        for i, task in enumerate(tasks):
            p = ivs.plan(iv, i, [t for t in base if t.group == i], task, runner, env.system_prompt(), "rollouts",
                         cfg.rollout.max_tokens_per_turn)
            reqs += p.requests if p is not None else []
        hinted = rollouts(eng, reqs, 2) if reqs else []
        return (float(np.mean([t.reward for t in base])), float(np.mean([t.reward for t in hinted])) if hinted else 0.0,
                [t for t in hinted if succeeded(t.reward)])

    @torch.no_grad()
    def stripped_logp(m, ids, attn):
        m.eval()
        logits = forward_logits(m, ids, attn, renderer.pad)[:, :-1].float() / cfg.rollout.temperature
        return grpo.gather_logprobs(logits, ids[:, 1:])  # (B, T), in the context without the hint

    base0, hinted0, found = successes(engine)
    if not found:
        raise SystemExit(f"no hinted rollout succeeded on {a.family} level {a.level}: nothing to measure")
    ids, attn, _, _, _, off, _ = pad_training_views(found, renderer.pad)
    off = off[:, 1:]
    lp0 = stripped_logp(model, ids, attn)
    revealed = off & (lp0 < np.log(0.5))  # (B, T): what the hint made likely and the warm start did not know
    n = int(revealed.sum())

    def row(name, lp, base, hinted):
        r = {"policy": name, "unguided_success": round(base, 3), "hinted_success": round(hinted, 3),
             "revealed_p_mean": round(float(lp[revealed].exp().mean()), 4),
             "rollout_p_geomean": round(float(np.exp(float(lp[off].sum()) / len(found))), 6)}
        print(json.dumps(r), flush=True)
        return r

    rows = [row("warm start", lp0, base0, hinted0)]
    for path in a.checkpoints:
        ckpt, _ = resolve_checkpoint(path)
        m, _ = load_policy(ckpt / "model")
        eng = TransformersEngine(m, renderer, batch_size=cfg.rollout.batch_size)
        b, h, _ = successes(eng)
        rows.append(row(str(path), stripped_logp(m, ids, attn), b, h))
    print(json.dumps({"family": a.family, "level": a.level, "how": a.how, "hinted_successes": len(found),
                      "revealed_tokens": n, "revealed_per_rollout": round(n / len(found), 2), "rows": rows}))


if __name__ == "__main__":
    main()
