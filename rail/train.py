"""The training loop: base rollouts -> score -> controller -> (interventions) -> filters -> GRPO update.

One step, as in ``docs/algorithms.md``:

1. open the step's budget; the controller says how many base groups to generate;
2. generate ``group_size`` rollouts per task (on-policy) and charge them;
3. score: verifier reward, rubric progress, tool failures;
4. the controller sees the scored groups and the remaining budget and returns interventions (``none``: no
   interventions; the operators come with the intervention controllers);
5. advantages and filters, then the clipped policy-gradient epochs;
6. metrics, periodic evaluation, an atomic checkpoint.

Every step's task stream and sampling seed derive from ``(run.seed, step)``, so a resumed run draws exactly
what the uninterrupted one would have.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from policy.checkpoint import (latest_checkpoint, load_optimizer_state, save_checkpoint,
                               verify_checkpoint, write_text_atomic)
from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
from policy.learner import GRPOLearner, LearnerSettings
from policy.model import count_parameters, load_policy
from policy.tokenizer import ChatRenderer
from rail.budget import BudgetLedger, cost_of
from rail.config import Config, merge, validate
from rail.controllers import CONTROLLERS, GroupView
from rail.envs import ToolRunner, make_env, rubric_status
from rail.evaluate import eval_metrics, evaluate, mean_over
from rail.policy_setup import make_policy
from rail.tracking import JsonlTracker, MlflowTracker, MultiTracker, NullTracker

log = logging.getLogger("rail")


class RunError(RuntimeError):
    """A run that cannot start or continue; the message says why and what to do."""


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def resolve_out(cfg: Config) -> Path:
    return Path(cfg.run.out or os.path.join("runs", cfg.run.name))


@dataclass
class RunState:
    step: int = 0
    wall_seconds: float = 0.0
    eval_initial: dict = field(default_factory=dict)
    eval_history: list = field(default_factory=list)
    mlflow_run_id: str | None = None
    tokens_per_rollout: float = 0.0  # running mean, for planning token budgets


class Trainer:
    def __init__(self, cfg: Config, out: Path, resume: bool = False, show_progress: bool = True):
        self.cfg, self.out, self.show_progress = cfg, out, show_progress
        self.t0 = time.perf_counter()
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.envs = {f: make_env(f, cfg.env.seed) for f in cfg.env.families}
        self.runners = {f: ToolRunner(e) for f, e in self.envs.items()}
        self.state = RunState()
        ckpt = None
        if resume:
            ckpt = latest_checkpoint(out / "checkpoints")
            saved = verify_checkpoint(ckpt)
            self.model, self.tokenizer = load_policy(ckpt / "model")
            self.policy_info = {"source": f"checkpoint {ckpt}"}
        else:
            self.model, self.tokenizer, self.policy_info = make_policy(cfg, self.envs, self._ws_progress())
        self.renderer = ChatRenderer(self.tokenizer)
        self.engine = TransformersEngine(self.model, self.renderer, batch_size=cfg.rollout.batch_size)
        L = cfg.learner
        mb_per_step = math.ceil(cfg.budget.rollouts_per_step / L.minibatch_size)
        self.learner = GRPOLearner(
            self.model,
            LearnerSettings(lr=L.lr, schedule=L.schedule, warmup_steps=L.warmup_steps, weight_decay=L.weight_decay,
                            epochs=L.epochs, minibatch_size=L.minibatch_size, eps_low=L.eps_low,
                            eps_high=L.eps_high, loss_agg=L.loss_agg, adv_scale=L.adv_scale, kl_coef=L.kl_coef,
                            grad_clip=L.grad_clip, drop_zero_variance=L.drop_zero_variance,
                            mask_all_tools_failed=L.mask_all_tools_failed, entropy_coef=L.entropy_coef,
                            temperature=cfg.rollout.temperature, max_tokens=cfg.max_rollout_tokens),
            total_updates=cfg.run.steps * L.epochs * mb_per_step, pad_id=self.renderer.pad)
        self.controller = CONTROLLERS[cfg.controller.name](config=cfg)
        self.ledger = BudgetLedger(cfg.budget.unit, cfg.step_budget(), cfg.budget.total)
        if ckpt is not None:
            self._restore(ckpt, saved)
        self.params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p,
                                     cfg.rollout.max_tokens_per_turn, cfg.rollout.max_turns)
        self.tracker = self._trackers(resume)
        self.timings: dict[str, float] = {"generate": 0.0, "score": 0.0, "controller": 0.0, "update": 0.0,
                                          "eval": 0.0}

    # ------------------------------------------------------------------ setup helpers
    def _ws_progress(self):
        if not self.show_progress or not self.cfg.warmstart.enabled or self.cfg.model.path:
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=self.cfg.warmstart.steps, desc="warm start", unit="step", leave=False)

        def cb(i, loss):
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if i == self.cfg.warmstart.steps - 1:
                bar.close()
        return cb

    def _trackers(self, resume: bool):
        jsonl = JsonlTracker(self.out / "metrics.jsonl", resume_step=self.state.step if resume else None)
        if not self.cfg.tracking.uri:
            return MultiTracker(jsonl, NullTracker())
        ml = MlflowTracker(self.cfg.tracking.uri, self.cfg.tracking.experiment, self.cfg.run.name,
                           run_id=self.state.mlflow_run_id if resume else None)
        self.state.mlflow_run_id = ml.run_id
        if not resume:
            ml.log_params(self.cfg.to_dict())
            ml.log_artifact(self.out / "config.json")
        return MultiTracker(jsonl, ml)

    def _restore(self, ckpt: Path, saved: dict) -> None:
        self.learner.load_state_dict(load_optimizer_state(ckpt))
        self.ledger.load_state_dict(saved["budget"])
        self.controller.load_state_dict(saved.get("controller", {}))
        rs = saved["run"]
        self.state = RunState(step=int(saved["step"]), wall_seconds=float(rs["wall_seconds"]),
                              eval_initial=rs["eval_initial"], eval_history=rs["eval_history"],
                              mlflow_run_id=rs.get("mlflow_run_id"),
                              tokens_per_rollout=float(rs.get("tokens_per_rollout", 0.0)))
        rng = saved.get("rng", {})
        if "python" in rng:
            random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
        if "torch" in rng:
            torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))

    def _checkpoint(self) -> None:
        st = self.state
        py = random.getstate()
        state = {
            "budget": self.ledger.state_dict(),
            "controller": self.controller.state_dict(),
            "run": {"wall_seconds": st.wall_seconds + self._elapsed(), "eval_initial": st.eval_initial,
                    "eval_history": st.eval_history, "mlflow_run_id": st.mlflow_run_id,
                    "tokens_per_rollout": st.tokens_per_rollout},
            "rng": {"python": [py[0], list(py[1]), py[2]], "torch": torch.get_rng_state().tolist()},
        }
        save_checkpoint(self.out / "checkpoints", st.step, self.model, self.tokenizer,
                        self.learner.state_dict(), state)

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # ------------------------------------------------------------------ one step
    def _sample_tasks(self, step: int, n_groups: int):
        rng = np.random.default_rng([self.cfg.run.seed, step, 1])
        fams = self.cfg.env.families
        out = []
        for g in range(n_groups):
            fam = fams[int(rng.integers(len(fams)))]
            (task,) = self.envs[fam].sample_tasks(rng, self.cfg.env.levels, 1)
            out.append((fam, task))
        return out

    def _score(self, trajs, tasks) -> None:
        for tr in trajs:
            fam, task = tasks[tr.group]
            env = self.envs[fam]
            r = env.reward(task, tr.steps)
            if not isinstance(r, (int, float)) or not math.isfinite(r) or not 0.0 <= r <= 1.0:
                raise RunError(f"environment '{fam}' returned reward {r!r} for task {task.id}; rewards must be "
                               f"finite and in [0, 1]. Fix the verifier; the last checkpoint is kept.")
            tr.reward = float(r)
            tr.rubric = rubric_status(env, task, tr.steps)

    def step(self, step: int) -> dict[str, float]:
        cfg, g = self.cfg, self.cfg.budget.group_size
        budget = self.ledger.open_step()
        t = time.perf_counter()
        n_groups = self.controller.plan_base(budget.limit, g, cfg.budget.unit,
                                             tokens_per_rollout=self.state.tokens_per_rollout or cfg.max_rollout_tokens / 4)
        tasks = self._sample_tasks(step, n_groups)
        requests = [RolloutRequest(task=task, env=self.runners[fam], system=self.envs[fam].system_prompt(), group=i)
                    for i, (fam, task) in enumerate(tasks) for _ in range(g)]
        cap = budget.remaining if cfg.budget.unit == "tokens" else None
        trajs = self.engine.generate(requests, self.params, seed=_seed(cfg.run.seed, step, 2), max_new_tokens=cap)
        budget.charge("base", cost_of(trajs, cfg.budget.unit))
        t_gen = time.perf_counter() - t

        t = time.perf_counter()
        self._score(trajs, tasks)
        t_score = time.perf_counter() - t

        t = time.perf_counter()
        groups = [GroupView(i, task, [tr for tr in trajs if tr.group == i]) for i, (_, task) in enumerate(tasks)]
        for gv in groups:
            gv.rewards = [tr.reward for tr in gv.trajectories]
        decisions = self.controller.decide(groups, budget.remaining, cfg.budget.unit)
        if decisions:  # the interventions issue wires the operators in here
            raise RunError(f"controller '{cfg.controller.name}' returned interventions, but no operator runs them")
        t_ctl = time.perf_counter() - t

        t = time.perf_counter()
        batch = self.learner.prepare(trajs)
        upd = self.learner.update(batch, torch.Generator().manual_seed(_seed(cfg.run.seed, step, 3)))
        t_upd = time.perf_counter() - t

        n_gen = [tr.n_generated for tr in trajs]
        self.state.tokens_per_rollout = float(np.mean(n_gen)) if n_gen else 0.0
        calls = [tr.tool_calls() for tr in trajs]
        n_calls = sum(c for c, _ in calls)
        rewards = np.array([tr.reward for tr in trajs])
        m = {
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/success_rate": float((rewards >= 1.0).mean()),
            "rollout/tokens_mean": float(np.mean(n_gen)),
            "rollout/turns_mean": float(np.mean([tr.n_turns for tr in trajs])),
            "rollout/truncated_share": float(np.mean([tr.truncated for tr in trajs])),
            "rollout/tool_failure_rate": (sum(f for _, f in calls) / n_calls) if n_calls else 0.0,
            "rollout/rubric_progress": float(np.mean([tr.rubric.progress for tr in trajs])),
            "rollout/count": float(len(trajs)),
            "groups/count": batch.stats["groups"],
            "groups/zero_variance_share": batch.stats["zero_variance_share"],
            "groups/all_tools_failed_trajectories": batch.stats["all_tools_failed"],
            "groups/trained_trajectories": batch.stats["kept"],
            "time/generate_s": t_gen, "time/score_s": t_score, "time/controller_s": t_ctl, "time/update_s": t_upd,
        }
        m.update({f"loss/{k}": v for k, v in upd.items()})
        m.update(self.ledger.close_step(budget))
        for k, v in (("generate", t_gen), ("score", t_score), ("controller", t_ctl), ("update", t_upd)):
            self.timings[k] += v
        return m

    # ------------------------------------------------------------------ run
    def _evaluate(self, step: int) -> dict:
        t = time.perf_counter()
        # one seed for every evaluation (common random numbers): differences between evaluations are the policy's
        res = evaluate(self.engine, self.envs, self.cfg, seed=_seed(self.cfg.run.seed, 10_000))
        self.timings["eval"] += time.perf_counter() - t
        self.state.eval_history.append({"step": step, "budget_spent": self.ledger.used, "success": res})
        self.tracker.log_metrics({**eval_metrics(res), "eval/easy_mean": mean_over(res, self.cfg.warmstart.levels),
                                  "budget/spent_total": float(self.ledger.used)}, step)
        return res

    def run(self) -> dict:
        cfg = self.cfg
        if self.state.step == 0 and not self.state.eval_history:
            self.state.eval_initial = self._evaluate(0)
        bar = None
        if self.show_progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.run.steps, initial=self.state.step, desc=f"train [{cfg.controller.name}]",
                       unit="step", dynamic_ncols=True)
        status = "FAILED"
        try:
            while self.state.step < cfg.run.steps:
                min_cost = cfg.budget.group_size
                if self.ledger.exhausted(min_cost):
                    log.info("budget.total spent after step %d", self.state.step)
                    break
                step = self.state.step + 1
                metrics = self.step(step)
                self.state.step = step
                self.tracker.log_metrics(metrics, step)
                if step % cfg.eval.every == 0 and step < cfg.run.steps:
                    self._evaluate(step)
                if step % cfg.run.checkpoint_every == 0 or step == cfg.run.steps:
                    self._checkpoint()
                if bar is not None:
                    bar.update(1)
                    last = self.state.eval_history[-1]["success"]
                    bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.2f}",
                                    easy=f"{mean_over(last, cfg.warmstart.levels):.2f}",
                                    spent=int(self.ledger.used))
            if self.state.eval_history[-1]["step"] != self.state.step:
                self._evaluate(self.state.step)
            if self.state.step % cfg.run.checkpoint_every != 0 and self.state.step != cfg.run.steps:
                self._checkpoint()  # stopped early by budget.total
            status = "FINISHED"
        finally:
            if bar is not None:
                bar.close()
            if status != "FINISHED":
                self.tracker.close("FAILED")
        summary = self.summary()
        write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=1, sort_keys=True))
        self.tracker.log_metrics({"summary/wall_seconds": summary["wall_seconds"]}, self.state.step)
        self.tracker.log_artifact(self.out / "summary.json")
        self.tracker.close("FINISHED")
        return summary

    def summary(self) -> dict:
        cfg, st = self.cfg, self.state
        initial, final = st.eval_initial, st.eval_history[-1]["success"]
        boundary = {fam: {"solved_at_start": [int(lv) for lv, v in rates.items() if v >= 0.05],
                          "unsolved_at_start": [int(lv) for lv, v in rates.items() if v < 0.05]}
                    for fam, rates in initial.items()}
        easy = [lv for lv in cfg.eval.levels if lv in cfg.warmstart.levels]
        beyond = [lv for lv in cfg.eval.levels if lv > max(cfg.warmstart.levels)]
        return {
            "name": cfg.run.name,
            "controller": cfg.controller.name,
            "wall_seconds": st.wall_seconds + self._elapsed(),
            "steps": st.step,
            "model": {"parameters": count_parameters(self.model), **self.policy_info},
            "budget": {"unit": cfg.budget.unit, "per_step": cfg.step_budget(), "total": cfg.budget.total,
                       "group_size": cfg.budget.group_size,
                       "spent": {"base": self.ledger.spent["base"], "intervention": self.ledger.spent["intervention"],
                                 "total": self.ledger.used}},
            "eval": {"initial": initial, "final": final, "history": st.eval_history,
                     "easy_levels": easy, "beyond_levels": beyond,
                     "easy_initial": mean_over(initial, easy), "easy_final": mean_over(final, easy),
                     "beyond_initial": mean_over(initial, beyond), "beyond_final": mean_over(final, beyond)},
            "boundary": boundary,
            "time": {k: round(v, 3) for k, v in self.timings.items()},
        }


def start_run(cfg: Config, show_progress: bool = True) -> tuple[Trainer, Path]:
    out = resolve_out(cfg)
    if (out / "config.json").exists():
        raise RunError(f"{out} already holds a run; resume it with `rail train --resume {out}` "
                       "or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "config.json", json.dumps(cfg.to_dict(), indent=1))
    try:
        return Trainer(cfg, out, show_progress=show_progress), out
    except BaseException:
        if not (out / "checkpoints").exists():  # nothing worth keeping yet
            import shutil
            shutil.rmtree(out, ignore_errors=True)
        raise


def resume_run(out: Path, show_progress: bool = True) -> tuple[Trainer, Path]:
    cpath = out / "config.json"
    if not cpath.is_file():
        raise RunError(f"{out}: no config.json; not a rail run directory")
    try:
        raw = json.loads(cpath.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{cpath}: corrupt ({e})") from None
    cfg = merge(Config(), raw, str(cpath))
    validate(cfg)
    return Trainer(cfg, out, resume=True, show_progress=show_progress), out


def eval_checkpoint(path: Path, tasks_per_level: int | None = None, temperature: float | None = None) -> dict:
    """Evaluate a checkpoint (a run directory, or a checkpoint directory inside one) on the held-out tasks."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        run_dir, ckpt = path, latest_checkpoint(path / "checkpoints")
    elif (path / "manifest.json").exists() or (path / "model").is_dir():
        run_dir, ckpt = path.parent.parent, path
    else:
        raise RunError(f"{path}: neither a run directory nor a checkpoint directory")
    verify_checkpoint(ckpt)
    raw = json.loads((run_dir / "config.json").read_text())
    cfg = merge(Config(), raw, str(run_dir / "config.json"))
    if tasks_per_level is not None:
        cfg.eval.tasks_per_level = tasks_per_level
    if temperature is not None:
        cfg.eval.temperature = temperature
    validate(cfg)
    model, tok = load_policy(ckpt / "model")
    envs = {f: make_env(f, cfg.env.seed) for f in cfg.env.families}
    engine = TransformersEngine(model, ChatRenderer(tok), batch_size=cfg.rollout.batch_size)
    return evaluate(engine, envs, cfg, seed=_seed(cfg.run.seed, 99_999))
