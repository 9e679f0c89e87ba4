# Time of N rollouts of the built-in default model (warm-started) on the transformers engine, three ways: one
# generate call of all N; a stream that starts N/2 and takes the other N/2 after its first turn (they join the
# running chunk; with --rounds K, in K waves after turns 1..K); serial generate calls, N/2 and then the other half
# (in K calls). Medians over repeats, the three timed alternately; the ratios to the single call are what a
# training step's later rounds cost. --clock cpu times this process's CPU time (use with --threads 1 on a busy
# machine: the work itself, whatever else runs).
# Run: .venv/bin/python experiments/bench_stream.py --threads 2 --n 128 --repeats 5 [--rounds 4] [--clock cpu]
"""Prints one JSON line per repeat and a final JSON summary line."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
from policy.tokenizer import ChatRenderer
from rail.config import build_config, validate
from rail.envs import ToolRunner, make_env
from rail.policy_setup import make_policy


def requests(cfg, envs, n: int, seed: int) -> list[RolloutRequest]:
    """The default training mix: every family, the config's levels."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        fam = cfg.env.families[i % len(cfg.env.families)]
        (task,) = envs[fam].sample_tasks(rng, cfg.env.levels, 1)
        out.append(RolloutRequest(task=task, env=ToolRunner(envs[fam], cfg.rollout.tool_format),
                                  system=envs[fam].system_prompt(), group=i))
    return out


def waves(reqs: list, rounds: int) -> list[list]:
    """The first half, then the second half in ``rounds`` parts."""
    half = len(reqs) // 2
    rest = reqs[half:]
    k = -(-len(rest) // rounds)
    return [reqs[:half]] + [rest[i:i + k] for i in range(0, len(rest), k)]


def one_call(eng, reqs, params, seed, rounds):
    return eng.generate(reqs, params, seed=seed)


def joined(eng, reqs, params, seed, rounds):
    """The first wave, then one more added after each turn."""
    first, *later = waves(reqs, rounds)
    with eng.stream(params, seed) as s:
        done = {}
        s.add(first)
        for w in later:
            done.update(s.advance())
            s.add(w)
        while s.open:
            done.update(s.advance())
    return list(done.values())


def serial(eng, reqs, params, seed, rounds):
    return [tr for i, w in enumerate(waves(reqs, rounds)) for tr in eng.generate(w, params, seed=seed + i)]


MODES = {"one_call": one_call, "joined": joined, "serial_calls": serial}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=128, help="rollouts per measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="waves the second half comes in")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--warmstart-cache", default="", help="warmstart.cache_dir (default: the config's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    sets = [{"tracking": {"uri": ""}}]
    if a.warmstart_cache:
        sets.append({"warmstart": {"cache_dir": a.warmstart_cache}})
    cfg = build_config("default", sets=sets)
    validate(cfg)
    envs = {f: make_env(f, cfg.env.seed) for f in cfg.env.families}
    model, tok, _ = make_policy(cfg, envs)
    renderer = ChatRenderer(tok)
    params = SamplingParams(cfg.rollout.temperature, 1.0, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_turns)
    eng = TransformersEngine(model, renderer, batch_size=max(a.n, 1))
    eng.generate(requests(cfg, envs, 8, 99), params, seed=0)  # warm-up
    times = {m: [] for m in MODES}
    per_token = {m: [] for m in MODES}
    for rep in range(a.repeats):
        row = {"repeat": rep}
        for name, run in MODES.items():
            reqs = requests(cfg, envs, a.n, rep)
            eng.stats.__init__()
            t = clock()
            trajs = run(eng, reqs, params, rep, a.rounds)
            dt = clock() - t
            assert len(trajs) == a.n
            gen = sum(tr.n_generated for tr in trajs)
            times[name].append(dt)
            per_token[name].append(dt / max(gen, 1))
            row[name] = {"seconds": round(dt, 3), "generated_tokens": gen, "forward_calls": eng.stats.forward_calls,
                         "turns": max(tr.n_turns for tr in trajs)}
        print(json.dumps(row), flush=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    med_tok = {m: statistics.median(v) for m, v in per_token.items()}
    print(json.dumps({
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {a.clock} clock",
        "n": a.n, "rounds": a.rounds, "repeats": a.repeats,
        "median_seconds": {m: round(v, 3) for m, v in med.items()},
        "median_ms_per_generated_token": {m: round(1000 * v, 4) for m, v in med_tok.items()},
        "over_one_call": {m: round(med[m] / med["one_call"], 3) for m in MODES},
        "per_token_over_one_call": {m: round(med_tok[m] / med_tok["one_call"], 3) for m in MODES},
    }))


if __name__ == "__main__":
    main()
