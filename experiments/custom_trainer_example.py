# The learned controller inside a trainer that is not rail's: a toy GRPO-style loop over a simulated policy,
# using only the controller's public API (create, decide for a batch of groups under a budget, report
# outcomes, save / load). No torch, no rail.
# Run: .venv/bin/python experiments/custom_trainer_example.py [--steps 60] [--out /tmp/ctl-example]
"""Prints the controller's mode, what it chose, and the policy's skill per level at the end."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

import controller.reward as R
from controller import Action, Group, LearnedController, Settings

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


def requests(policy: ToyPolicy, groups: list[tuple[int, list[float]]], step: int, steps: int) -> list[Group]:
    """What the trainer knows about each group, and the interventions it offers (cost = rollouts)."""
    out = []
    for i, (level, rewards) in enumerate(groups):
        ctx = {"level": str(level), "successes": sum(rewards), "pass_rate": policy.p[level],
               "train_progress": step / steps}
        acts = [Action(f"{how}x{k}", {f"how={how}": 1.0, "how_many": float(k)}, float(k))
                for how in HELP for k in (2, 4)]
        heuristic = "hintx2" if sum(rewards) == 0 else None  # the rule this trainer used before
        out.append(Group(f"g{i}", ctx, acts, heuristic=heuristic))
    return out


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
    ctl = LearnedController(Settings(min_events=40, check_every=20), seed=a.seed, trace_dir=out / "traces")
    chosen: Counter = Counter()
    for step in range(a.steps):
        if step == a.steps // 2:  # the trainer checkpoints and restarts: the controller resumes where it stopped
            ctl.save(out / "controller.json")
            ctl = LearnedController.load(out / "controller.json", trace_dir=out / "traces")
        levels = rng.choice(LEVELS, size=a.groups)
        groups = [(int(lv), policy.rollouts(int(lv), a.group_size, rng)) for lv in levels]
        decisions = ctl.decide(requests(policy, groups, step, a.steps), budget=a.budget, tag=f"s{step}-")
        base_signal = R.opportunity([r for _, r in groups], a.group_size, 2)
        for d, (level, rewards) in zip(decisions, groups):
            if not d.intervenes:
                ctl.feedback(d.id, base_signal)  # doing nothing earns what fresh groups earn per unit
                policy.update(level, rewards)
                continue
            how, k = d.action.name.split("x")
            extra = policy.rollouts(level, int(k), rng, boost=HELP[how][level])
            ctl.feedback(d.id, R.reward(rewards, extra, d.action.cost, unit=2), {"level": level})
            policy.update(level, rewards + extra)
            chosen[(level, d.action.name)] += 1
    print(json.dumps({"mode": ctl.mode, "transitions": ctl.transitions, "events": ctl.learned,
                      "skill": {lv: round(p, 3) for lv, p in policy.p.items()},
                      "most_chosen": {f"L{lv}:{n}": c for (lv, n), c in chosen.most_common(6)},
                      "trace": str(ctl.trace_path)}, indent=1))


if __name__ == "__main__":
    main()
