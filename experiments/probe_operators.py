# What each intervention operator can do at each level, on the warm-started policy before any RL: the base
# success rate, where failed rollouts first violate the rubric, and the success rate of rollouts produced by
# each operator from each failed group's source trajectory. It shows where the capability boundary lies and
# which help the policy can use there (docs/benchmarks.md, "What the operators can do at the boundary"). For
# the successful rollouts of each operator it also prints what the learner would train on: the importance
# ratio pi(stripped context) / pi(context sampled in) on the tokens sampled under guidance (median, and the
# share below the PPO clip's 1 - eps_low, where a positive advantage's gradient is scaled by the ratio itself),
# the stripped-context probability of an injected reference step's tokens, and the shift filter's acceptance.
# Run: .venv/bin/python experiments/probe_operators.py [--tasks 24] [--set warmstart.guided_levels=[1,2]]
"""Prints one JSON line per (level, family) and a final JSON summary line."""

from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np
import torch

from _probe import add_common_args, operator_rollouts, rollout_groups, setup
from policy import grpo
from policy.learner import pad_training_views
from policy.packing import forward_logits
from policy.records import succeeded
from rail.envs import ToolRunner

OPERATORS = ("resample@violation", "rubric_hint@violation", "guided_step@violation", "action_guide@start",
             "action_guide@violation")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=24, help="tasks per family and level")
    ap.add_argument("--group", type=int, default=8, help="base rollouts per task, and rollouts per operator")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4])
    add_common_args(ap)
    a = ap.parse_args()
    t0 = time.perf_counter()
    cfg, envs, model, renderer, engine, params, info = setup(a)
    t_ws = time.perf_counter() - t0
    rng = np.random.default_rng([cfg.run.seed, 5])
    rows = []
    for level in a.levels:
        for fam in cfg.env.families:
            env, runner = envs[fam], ToolRunner(envs[fam])
            tasks = env.sample_tasks(rng, [level], a.tasks)
            groups = rollout_groups(engine, params, env, runner, tasks, a.group, seed=level)
            trajs = [tr for g in groups for tr in g]
            failed = [tr for tr in trajs if tr.reward < 1.0 and tr.rubric.first_violated is not None]
            first = collections.Counter(tr.rubric.first_violated for tr in failed)
            row = {"level": level, "family": fam, "base_success": round(float(np.mean([t.reward for t in trajs])), 3),
                   "failed_groups": sum(all(t.reward < 1.0 for t in g) for g in groups),
                   "first_violated_item": {str(k): v for k, v in sorted(first.items())}}
            for key in OPERATORS:
                _, out, rs = operator_rollouts(engine, params, env, runner, tasks, groups, key, a.group,
                                               cfg.rollout.max_tokens_per_turn, seed=100 + level)
                row[key] = round(float(np.mean(rs)), 3) if rs else None
                row[key + ":trained"] = trained_view([tr for tr, r in zip(out, rs) if succeeded(r)], model, renderer.pad, cfg)
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {"warmstart": info.get("warmstart"), "warmstart_seconds": round(t_ws, 1),
               "guided_levels": cfg.warmstart.guided_levels or cfg.warmstart.levels,
               "seconds": round(time.perf_counter() - t0, 1),
               "table": {f"{r['family']}/L{r['level']}": {k: r[k] for k in ("base_success", *OPERATORS)} for r in rows}}
    print(json.dumps(summary))


@torch.no_grad()
def trained_view(trajs, model, pad_id: int, cfg) -> dict | None:
    """What the learner would see of these (successful, intervened) rollouts under the current weights."""
    if not trajs:
        return None
    ratios, injected_p, shifts = [], [], []
    for i in range(0, len(trajs), 64):
        ids, attn, _, old, _, off, inj = pad_training_views(trajs[i : i + 64], pad_id)
        logits = forward_logits(model, ids, attn, pad_id)[:, :-1].float() / cfg.rollout.temperature
        logp = grpo.gather_logprobs(logits, ids[:, 1:])  # (B, T) in the stripped training context
        off, inj, old = off[:, 1:], inj[:, 1:], old[:, 1:]
        ratios += torch.exp(logp - old)[off].tolist()
        injected_p += torch.exp(logp)[inj].tolist()
        shifts += grpo.shift_measure(logp, old, off).tolist()
    r = np.array(ratios)
    return {"rollouts": len(trajs),
            "guided_tokens": len(r), "ratio_median": round(float(np.median(r)), 3) if len(r) else None,
            "ratio_below_clip": round(float((r < 1 - cfg.learner.eps_low).mean()), 3) if len(r) else None,
            "injected_tokens": len(injected_p),
            "injected_p_median": round(float(np.median(injected_p)), 3) if injected_p else None,
            "injected_p_below_0.1": round(float((np.array(injected_p) < 0.1).mean()), 3) if injected_p else None,
            "shift_accepted": round(float((np.array(shifts) <= cfg.learner.shift_threshold).mean()), 3)}


if __name__ == "__main__":
    main()
