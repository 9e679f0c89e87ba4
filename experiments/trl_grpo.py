# Trains a tool-using policy with TRL's GRPOTrainer and rail's learned intervention controller: the built-in
# model (warm-started and cached as `rail train` does) on the built-in environments, rail's engine and
# interventions behind TRL's rollout_func, rail's controller state saved with TRL's checkpoints. A complete TRL
# script to copy; everything TRL trains with is one GRPOConfig (docs/integrations.md).
# Run: .venv/bin/pip install -e ".[trl]"
#      .venv/bin/python experiments/trl_grpo.py --max-steps 3 --out /tmp/rail-trl        (a few minutes on CPU)
#      .venv/bin/python experiments/trl_grpo.py --max-steps 6 --out /tmp/rail-trl --resume  (continues from its checkpoint)
#      .venv/bin/python experiments/make_tiny_model.py /tmp/tiny && .venv/bin/python experiments/trl_grpo.py \
#          --model /tmp/tiny --set rollout.tool_format=hermes --max-steps 3 --out /tmp/rail-trl-tiny
"""Prints held-out success before and after, the interventions table and the controller's line, and checks that
vowpal-wabbit-next's DSJson parser learns the controller's trace."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-steps", type=int, default=30, help="TRL optimizer steps (one generation each)")
    ap.add_argument("--out", default="/tmp/rail-trl", help="GRPOConfig.output_dir")
    ap.add_argument("--preset", default="default", help="rail preset for the model, environments and controller")
    ap.add_argument("--model", default="", help="a Hugging Face model directory (default: the built-in model)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a rail config field")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (groups) per step")
    ap.add_argument("--num-generations", type=int, default=8, help="slots per prompt (base and interventions)")
    ap.add_argument("--eval-tasks", type=int, default=8, help="held-out tasks per family and level (0: no eval)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    a = ap.parse_args()

    from rail.config import ConfigError, build_config, parse_set
    try:
        sets = [parse_set(s) for s in a.set] + [{"run": {"seed": a.seed}}]
        if a.model:
            sets.append({"model": {"path": a.model}})
        cfg = build_config(a.preset, sets=sets)
    except ConfigError as e:
        sys.exit(f"error: {e}")

    import trl
    from trl import GRPOConfig, GRPOTrainer

    from controller import traces
    from rail.evaluate import evaluate, mean_over
    from rail.integrations.trl import RailTRL
    from rail.policy_setup import make_policy
    from rail.report import format_eval
    from rail.engines import close_engine, make_engine
    from policy.tokenizer import ChatRenderer

    t0 = time.perf_counter()
    rail = RailTRL(cfg)
    model, tokenizer, info = make_policy(cfg, rail.envs)  # the built-in model or --model, warm-started (cached)
    print(f"policy: {info.get('source')} ({info.get('warmstart', 'no warm start')}); trl {trl.__version__}")
    L = cfg.learner
    args = GRPOConfig(
        output_dir=a.out, max_steps=a.max_steps, seed=a.seed, use_cpu=True, bf16=False, report_to=[],
        gradient_checkpointing=False, logging_steps=1, save_steps=max(1, a.max_steps // 3), save_total_limit=2,
        num_generations=a.num_generations, per_device_train_batch_size=a.prompts * a.num_generations,
        # rail's learner settings where GRPOTrainer has the same knob (docs/integrations.md lists the rest)
        learning_rate=L.lr, lr_scheduler_type="cosine", epsilon=L.eps_low, epsilon_high=L.eps_high,
        loss_type="dapo", beta=0.0, max_grad_norm=L.grad_clip, scale_rewards="group",
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        # rollouts sampled under a hint or plan whose behaviour log-probs are far above the stripped context's
        # are filtered by rail (learner.shift_threshold); TRL's own off-policy mask reads the same log-probs
        off_policy_mask_threshold=None,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=rail.reward, args=args, train_dataset=rail.dataset(256),
                          processing_class=tokenizer, rollout_func=rail.rollout_func, callbacks=[rail.callback])

    def held_out() -> dict:
        cfg.eval.tasks_per_level = a.eval_tasks
        engine = make_engine(cfg, model, ChatRenderer(tokenizer), Path(a.out) / "eval-engine")
        try:
            return evaluate(engine, rail.envs, cfg, seed=a.seed + 99_999)
        finally:
            close_engine(engine)

    before = held_out() if a.eval_tasks else None
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    after = held_out() if a.eval_tasks else None

    print()
    if before is not None:
        easy = [lv for lv in cfg.eval.levels if lv in cfg.warmstart.levels]
        print("held-out unguided success, before -> after:")
        print(format_eval(after, before))
        print(f"easy levels {easy}: {mean_over(before, easy):.3f} -> {mean_over(after, easy):.3f}")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"trained {trainer.state.global_step} steps, loss of the last {losses[-1]:+.4f}" if losses else "")
    print(rail.report())
    trace = rail.summary()["controller_state"].get("trace")
    if trace and hasattr(rail.controller, "ctl"):  # vowpal-wabbit-next's DSJson parser reads and learns every line, back to the live controller's model
        same = traces.replay(trace).weights_equal(rail.controller.ctl.bandit)
        print(f"trace: {len(traces.read(trace))} events replayed by VW's DSJson parser: "
              f"{'the same model as the live controller' if same else 'a DIFFERENT model from the live controller'}")
    print(f"wall: {time.perf_counter() - t0:.0f}s; checkpoints in {a.out}")


if __name__ == "__main__":
    main()
