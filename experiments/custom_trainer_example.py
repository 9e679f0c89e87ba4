# The learned controller inside a trainer that is not rail's: a toy GRPO-style loop over a simulated policy that
# drives the controller's seam, controller.Session (scored groups with their menus of priced interventions in,
# decisions out, the chosen interventions' rollouts in; escalation rounds, rewards, traces and state handled inside). No torch,
# no rail.
# Run: .venv/bin/python experiments/custom_trainer_example.py [--steps 60] [--out /tmp/ctl-example]
"""Prints the controller's mode, what it chose, and the policy's skill per level at the end."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

import controller.reward as R
from controller import Group, Intervention, Rollout, Session, SessionSettings, Settings

LEVELS = (1, 2, 3, 4)
# what each intervention multiplies the policy's chance of success by, per level (hidden from the controller)
HELP = {"hint": {1: 1.2, 2: 1.5, 3: 2.0, 4: 1.5}, "plan": {1: 1.0, 2: 1.5, 3: 4.0, 4: 6.0}}


class ToyPolicy:
    """A policy reduced to one success probability per level, which improves where groups carry signal."""

    def __init__(self):
        self.p = {1: 0.5, 2: 0.25, 3: 0.04, 4: 0.01}

    def rollouts(self, level: int, n: int, rng, boost: float = 1.0) -> list[float]:
        return [float(x) for x in rng.random(n) < min(0.95, self.p[level] * boost)]

    def update(self, level: int, rewards: list[float]) -> None:
        self.p[level] = min(0.95, self.p[level] + 0.004 * R.signal(rewards))


def scored(rewards: list[float]) -> list[Rollout]:
    """What this trainer knows of a rollout: its reward (success is reward 1; no rubric, no tools)."""
    return [Rollout(r, r >= 1.0) for r in rewards]


def group(i: int, level: int, rewards: list[float]) -> Group:
    """A scored group and the interventions this trainer can run on it, priced in rollouts."""
    menu = [Intervention(f"{how}x{k}", f"{how}@start", k, cost=k, features={f"how={how}": 1.0, "how_many": float(k)})
            for how in HELP for k in (2, 4)]
    return Group(f"g{i}", "toy", level, scored(rewards), menu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16, help="intervention rollouts per step")
    ap.add_argument("--out", default="/tmp/rail-controller-example")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    policy = ToyPolicy()
    # the heuristic it shadows (the rule this trainer used before): a hint, then a plan if the hint failed
    settings = SessionSettings(bandit=Settings(min_events=40, check_every=20), ladder=("hint@start", "plan@start"),
                               ladder_size=2, group_size=a.group_size, unit=2.0)
    ctl = Session(settings, seed=a.seed, trace_dir=out / "traces")
    chosen: Counter = Counter()
    for step in range(a.steps):
        if step == a.steps // 2:  # the trainer checkpoints and restarts: the controller resumes where it stopped
            ctl.save(out / "controller.json")
            ctl = Session.load(out / "controller.json", trace_dir=out / "traces")
        levels = [int(lv) for lv in rng.choice(LEVELS, size=a.groups)]
        rewards = [policy.rollouts(lv, a.group_size, rng) for lv in levels]
        ctl.begin_step(step, a.steps, step_budget=a.groups * a.group_size + a.budget)
        ctl.add([group(i, lv, r) for i, (lv, r) in enumerate(zip(levels, rewards))])
        left = a.budget
        while True:  # rounds: a group an intervention left without a success is asked again
            decisions = [d for d in ctl.decide(left) if d.intervenes]
            if not decisions:
                break
            for d in decisions:
                i, iv = int(d.group[1:]), d.intervention
                extra = policy.rollouts(levels[i], iv.size, rng, boost=HELP[iv.key.split("@")[0]][levels[i]])
                ctl.ran(d.id, scored(extra), iv.cost)
                rewards[i] += extra
                left -= iv.cost
                chosen[(levels[i], iv.name)] += 1
        ctl.end_step()  # the controller's rewards, learning and traces
        for lv, r in zip(levels, rewards):
            policy.update(lv, r)
    print(json.dumps({"mode": ctl.mode, "transitions": ctl.ctl.transitions, "events": ctl.ctl.learned,
                      "skill": {lv: round(p, 3) for lv, p in policy.p.items()},
                      "most_chosen": {f"L{lv}:{n}": c for (lv, n), c in chosen.most_common(6)},
                      "trace": str(ctl.ctl.trace_path)}, indent=1))


if __name__ == "__main__":
    main()
