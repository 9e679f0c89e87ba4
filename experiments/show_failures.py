# Where does a trained policy fail? Samples a checkpoint on one family and level of the held-out pool and
# prints each failed episode beside the task's action guide, with the first violated rubric item.
# Run: .venv/bin/python experiments/show_failures.py runs/default/checkpoints/step_000100 --family lookup --level 2
"""Prints the failed episodes, then one JSON line: success rate and how often each rubric item was violated first."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
from policy.model import load_policy
from policy.records import succeeded
from policy.tokenizer import ChatRenderer
from rail.envs import ToolRunner, make_env, rubric_status
from rail.train import resolve_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path, help="a run directory (its latest checkpoint) or …/checkpoints/step_N")
    ap.add_argument("--family", default="lookup")
    ap.add_argument("--level", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--show", type=int, default=6, help="failed episodes to print")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    ckpt, cfg = resolve_checkpoint(a.checkpoint)
    model, tok = load_policy(ckpt / "model")
    env = make_env(a.family, cfg.env.seed)
    tasks = env.eval_tasks(a.level, a.tasks)
    params = SamplingParams(cfg.eval.temperature, 1.0, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_turns)
    runner = ToolRunner(env)
    trajs = TransformersEngine(model, ChatRenderer(tok)).generate(
        [RolloutRequest(task=t, env=runner, system=env.system_prompt()) for t in tasks], params, seed=a.seed)
    first_violated: Counter = Counter()
    shown, solved = 0, 0
    for task, tr in zip(tasks, trajs):
        if succeeded(env.reward(task, tr.steps)):
            solved += 1
            continue
        st = rubric_status(env, task, tr.steps)
        first_violated[st.first_violated if st.first_violated is not None else -1] += 1
        if shown < a.show:
            shown += 1
            print(f"task   {task.prompt}")
            print(f"guide  {'  '.join(x.render() for x in task.action_guide)}")
            for s in tr.steps:
                print(f"  turn {s.text}  ->  {s.observation}")
            print()
    print(json.dumps({"family": a.family, "level": a.level, "tasks": len(tasks), "success": solved / len(tasks),
                      "first_violated_item": {str(k): v for k, v in sorted(first_violated.items())}}))


if __name__ == "__main__":
    main()
