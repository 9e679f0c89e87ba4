# Can the policy learn what a rubric hint revealed, from the hinted rollouts alone, when nothing else competes for
# the update? A focused loop on one family and level (default: kin level 3, beyond the warm start's knowledge):
# every iteration samples `--groups` tasks, rolls out `--group` unguided base rollouts each, adds `--hinted`
# rollouts of one intervention (default rubric_hint@start) for every group without a success, and takes one GRPO
# update with the default learner (guidance stripped, behaviour ratio clipped, shift filter) on base + hinted
# rollouts mixed per group. It prints, per iteration, the base and hinted success and the shift filter's counts,
# and the held-out *unguided* success of that family and level every `--eval-every` iterations.
# It isolates the learning-from-intervened-rollouts mechanism from the trainer's mix of families and levels
# (docs/benchmarks.md, "Beyond a knowledge boundary").
# Run: .venv/bin/python experiments/probe_hint_learning.py [--iters 30] [--how rubric_hint@violation] [--threads 1]
"""Prints one JSON line per iteration and per evaluation, and a final JSON summary line."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from _probe import add_common_args, setup
from policy.engine import RolloutRequest
from policy.learner import GRPOLearner
from policy.records import succeeded
from rail import interventions as ivs
from rail.envs import ToolRunner, rubric_status
from rail.policy_setup import RehearsalSource
from rail.train import learner_settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="kin")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--how", default="rubric_hint@start", help="the intervention, how@where")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--groups", type=int, default=8, help="tasks per iteration")
    ap.add_argument("--group", type=int, default=8, help="base rollouts per task")
    ap.add_argument("--hinted", type=int, default=4, help="intervention rollouts per group without a success")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-tasks", type=int, default=48)
    add_common_args(ap)
    a = ap.parse_args()
    cfg, envs, model, renderer, engine, params, info = setup(a)
    rehearsal = RehearsalSource(renderer, envs, cfg) if cfg.learner.rehearsal > 0 else None
    learner = GRPOLearner(model, learner_settings(cfg, schedule="constant"), total_steps=a.iters, pad_id=renderer.pad,
                          rehearsal_source=rehearsal)
    env, runner = envs[a.family], ToolRunner(envs[a.family])
    held_out = env.eval_tasks(a.level, a.eval_tasks)
    iv = ivs.Intervention.parse(a.how, a.hinted)

    def rollouts(tasks, per_task, seed):
        reqs = [RolloutRequest(task=t, env=runner, system=env.system_prompt(), group=i)
                for i, t in enumerate(tasks) for _ in range(per_task)]
        return score(engine.generate(reqs, params, seed=seed), tasks)

    def score(trajs, tasks):
        for tr in trajs:
            task = tasks[tr.group]
            tr.reward, tr.rubric = env.reward(task, tr.steps), rubric_status(env, task, tr.steps)
        return trajs

    def evaluate(it):
        s = float(np.mean([t.reward for t in rollouts(held_out, 1, 10_000 + it)]))
        print(json.dumps({"iter": it, "eval_unguided": round(s, 4)}), flush=True)
        return s

    t0, rng, curve, rows = time.perf_counter(), np.random.default_rng([cfg.run.seed, 11]), [], []
    for it in range(a.iters):
        if it % a.eval_every == 0:
            curve.append((it, evaluate(it)))
        tasks = env.sample_tasks(rng, [a.level], a.groups)
        base = rollouts(tasks, a.group, it)
        reqs = []
        for i in range(len(tasks)):
            group = [t for t in base if t.group == i]
            if any(succeeded(t.reward) for t in group):
                continue
            p = ivs.plan(iv, i, group, tasks[i], runner, env.system_prompt(), "rollouts", cfg.rollout.max_tokens_per_turn)
            reqs += p.requests if p is not None else []
        helped = score(engine.generate(reqs, params, seed=50_000 + it), tasks) if reqs else []
        batch = learner.prepare(base + helped, compose="mix")
        if rehearsal is not None:
            rehearsal.begin_step(it)
        upd = learner.update(batch, torch.Generator().manual_seed(it))
        row = {"iter": it, "base_success": round(float(np.mean([t.reward for t in base])), 4),
               "helped_rollouts": len(helped),
               "helped_success": round(float(np.mean([t.reward for t in helped])), 4) if helped else None,
               "shift_accepted": int(batch.stats["shift_accepted"]), "shift_rejected": int(batch.stats["shift_rejected"]),
               "trained": len(batch.trajectories), "updates": int(upd.get("updates", 0))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    curve.append((a.iters, evaluate(a.iters)))
    print(json.dumps({"family": a.family, "level": a.level, "how": a.how, "warmstart": info.get("warmstart"),
                      "eval_curve": curve, "seconds": round(time.perf_counter() - t0, 1),
                      "helped_success_first_5": round(float(np.mean([r["helped_success"] or 0 for r in rows[:5]])), 3),
                      "helped_success_last_5": round(float(np.mean([r["helped_success"] or 0 for r in rows[-5:]])), 3)}))


if __name__ == "__main__":
    main()
