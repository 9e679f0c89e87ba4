# Does the warm start work on every seed? For each seed (and, with --world-per-seed, each seed's own world:
# env.seed = the seed), the warm start of the config is trained (or read from its cache) with its check
# (warmstart.target on held-out tasks of warmstart.levels, more cycles up to warmstart.max_steps), and its
# outcome printed: updates taken, the check's success, met or not.
# Run: .venv/bin/python experiments/warmstart_seeds.py --seeds 10 --world-per-seed [--set env.families=...] --threads 1
"""Prints one JSON line per seed and a final JSON summary line."""

from __future__ import annotations

import argparse
import json
import time

import torch

from rail.config import build_config, parse_set
from rail.envs import make_envs
from rail.policy_setup import make_policy
from rail.rundir import RunError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--world-per-seed", action="store_true", help="env.seed = the seed (each seed its own world)")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for seed in range(a.seeds):
        sets = [{"run": {"seed": seed}, "tracking": {"uri": ""}}, *[parse_set(s) for s in a.sets]]
        if a.world_per_seed:
            sets.append({"env": {"seed": seed}})
        cfg = build_config(a.preset, sets=sets)
        envs = make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)
        t = time.perf_counter()
        try:
            _, _, info = make_policy(cfg, envs)
            check = info.get("warmstart_check") or {}
            row = {"seed": seed, "env_seed": cfg.env.seed, **check, "how": info["warmstart"].split(" ")[0]}
        except RunError as e:
            row = {"seed": seed, "env_seed": cfg.env.seed, "met": False, "error": str(e)}
        row["seconds"] = round(time.perf_counter() - t, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    met = [r["seed"] for r in rows if r.get("met")]
    print(json.dumps({"seeds": a.seeds, "met": len(met), "missed": [r["seed"] for r in rows if not r.get("met")],
                      "target": cfg.warmstart.target, "max_steps": cfg.warmstart.max_steps,
                      "extended": [r["seed"] for r in rows if r.get("updates", 0) > cfg.warmstart.steps]}))


if __name__ == "__main__":
    main()
