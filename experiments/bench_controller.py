# Cost of the learned controller: microseconds per decision (decide + feedback, one group) on requests shaped
# like the trainer's, the same through the seam a trainer drives (controller.Session: a step with one scored
# group, its decision, its outcome and the reward), and the share of a default training step's time the
# controller's own work takes in `rail train`.
# Run: .venv/bin/python experiments/bench_controller.py [--events 2000] [--steps 6] [--skip-run]
"""Prints one JSON line per measurement and a final JSON summary line."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from controller import Context, Group, Intervention, LearnedController, Rollout, Session, SessionSettings, Settings

HOWS = ("resample", "rubric_hint", "action_guide", "guided_step")
WHERES = ("start", "violation", "before")


def synthetic_group(rng: np.random.Generator, i: int) -> tuple[Context, dict[str, float]]:
    """A group's bandit context with the trainer's context keys and a menu of 7 operators x 2 sizes, plus a hidden
    reward per intervention that depends on the context (so the bandit has something to learn)."""
    level = int(rng.integers(1, 5))
    succ = int(rng.integers(0, 3)) if level <= 2 else 0
    ctx = {"family": "calc" if i % 2 else "lookup", "level": str(level), "family_level": f"f{i % 2}/{level}",
           "successes": float(succ), "success_rate": succ / 4, "reward_spread": 0.4 if succ else 0.0,
           "progress_mean": float(rng.random()), "progress_max": float(rng.random()),
           "violated_item": str(int(rng.integers(0, 4))), "violated_turn": float(rng.integers(0, 4)),
           "tool_failure_rate": float(rng.random() * 0.3), "logprob_mean": float(-rng.random()),
           "pass_rate": float(rng.random() * 0.5), "train_progress": 0.5, "budget_left": 0.5,
           "round": float(i % 3), "tried": float(i % 3), "last_tried": "none" if i % 3 == 0 else "resample@violation"}
    acts, truth = [], {}
    for how in HOWS:
        for where in WHERES[: 2 if how != "guided_step" else 1]:
            for k in (2, 4):
                name = f"{how}@{where}x{k}"
                acts.append(Intervention(name, f"{how}@{where}", k, float(k), {
                    f"how={how}": 1.0, f"where={where}": 1.0, "how_many": float(k), "cost_share": k / 128}))
                truth[name] = (0.6 if (how == "guided_step") == (level >= 3) else 0.2) / (k / 2)
    return Context(f"g{i}", ctx, acts, heuristic=acts[0].name), truth


def decision_latency(events: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ctl = LearnedController(Settings(), seed=seed)
    times = []
    for i in range(events):
        g, truth = synthetic_group(rng, i)
        t = time.perf_counter()
        (d,) = ctl.decide([g], budget=64, tag=f"b{i}-")
        r = truth.get(d.intervention.name, 0.3) if d.intervenes else 0.3
        ctl.feedback(d.id, float(rng.random() < r))
        times.append(time.perf_counter() - t)
    batch_times = []
    for j in range(50):  # a step's worth: 16 groups decided together, then 16 feedbacks
        gs = [synthetic_group(rng, 16 * j + k)[0] for k in range(16)]
        t = time.perf_counter()
        ds = ctl.decide(gs, budget=64, tag=f"s{j}-")
        for d in ds:
            ctl.feedback(d.id, 0.5)
        batch_times.append((time.perf_counter() - t) / 16)
    us = [x * 1e6 for x in times]
    return {"measure": "decision", "events": events, "actions_per_group": len(g.interventions) + 1,
            "us_per_decision": statistics.median(us), "us_p90": float(np.percentile(us, 90)),
            "us_per_decision_batched16": statistics.median(x * 1e6 for x in batch_times)}


def session_latency(events: int, seed: int) -> dict:
    """Through the seam: one step per event with one group of 8 scored rollouts (rubric, tools, 100 log-probs
    each) and the same menu: begin_step, add, decide, ran (when it intervenes), end_step."""
    rng = np.random.default_rng(seed)
    s = Session(SessionSettings(), seed=seed)
    times = []
    for i in range(events):
        g, truth = synthetic_group(rng, i)
        level = int(g.features["level"])
        rollouts = [Rollout(float(ok), bool(ok), float(rng.random()), None if ok else int(rng.integers(0, 4)),
                            int(rng.integers(0, 4)), 3, int(rng.integers(0, 2)), list(-rng.random(100)), 100)
                    for ok in rng.random(8) < 0.5 / level]
        menu = [Intervention(a.name, a.key, a.size, a.cost, {k: v for k, v in a.features.items() if k != "cost_share"})
                for a in g.interventions]
        t = time.perf_counter()
        s.begin_step(i, events, 128)
        s.add([Group("g", g.features["family"], level, rollouts, menu)])
        (d,) = s.decide(64)
        if d.intervenes:
            ok = rng.random(d.intervention.size) < truth.get(d.intervention.name, 0.3)
            s.ran(d.id, [Rollout(float(x), bool(x)) for x in ok], d.intervention.cost)
        s.end_step()
        times.append(time.perf_counter() - t)
    return {"measure": "session", "events": events, "us_per_step_of_one_group": statistics.median(times) * 1e6}


def training_overhead(steps: int, seed: int) -> dict:
    """A short default run (controller ``rail``): the controller's own time over the steps' time."""
    from rail.config import build_config
    from rail.train import start_run

    with tempfile.TemporaryDirectory() as d:
        cfg = build_config("default", sets=[{"tracking": {"uri": ""}, "run": {"steps": steps, "out": d + "/run",
                                                                                "seed": seed},
                                             "eval": {"every": 10_000, "tasks_per_level": 8}}])
        trainer, out = start_run(cfg, show_progress=False)
        trainer.run()
        lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps_m = [m for m in lines if "time/generate_s" in m]
    parts = ("time/generate_s", "time/rounds_s", "time/score_s", "time/controller_s", "time/update_s")
    step_s = sum(m[k] for m in steps_m for k in parts)
    ctl_s = sum(m["time/controller_s"] for m in steps_m)
    rounds_s = sum(m["time/rounds_s"] for m in steps_m)
    return {"measure": "training", "steps": len(steps_m), "step_seconds": step_s / len(steps_m),
            "controller_seconds": ctl_s, "overhead_share": ctl_s / step_s,
            "intervention_rounds_share": rounds_s / step_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=6, help="default-preset training steps for overhead_share")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-run", action="store_true", help="only the decision latency")
    a = ap.parse_args()
    summary = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
               "python": platform.python_version()}
    lat = decision_latency(a.events, a.seed)
    print(json.dumps(lat), flush=True)
    summary.update({k: lat[k] for k in ("us_per_decision", "us_p90", "us_per_decision_batched16")})
    ses = session_latency(a.events, a.seed)
    print(json.dumps(ses), flush=True)
    summary["us_per_session_decision"] = ses["us_per_step_of_one_group"]
    if not a.skip_run:
        tr = training_overhead(a.steps, a.seed)
        print(json.dumps(tr), flush=True)
        summary.update({k: tr[k] for k in ("overhead_share", "intervention_rounds_share", "step_seconds")})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
