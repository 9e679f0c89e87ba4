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

import copy
import json
import logging
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from controller.traces import TraceError
from policy.checkpoint import (CheckpointError, find_checkpoint, load_optimizer_state, remove_stale_temps,
                               save_checkpoint, verify_checkpoint)
from policy.fileio import write_text_atomic
from policy.engine import SamplingParams
from policy.learner import GRPOLearner, LearnerSettings
from policy.model import count_parameters, load_policy, resolve_device
from policy.records import succeeded
from policy.tokenizer import ChatRenderer
from rail.budget import BudgetLedger, cost_of
from rail.config import Config, merge, read_json, validate
from rail.controllers import CONTROLLERS, compose_of
from rail.engines import close_engine, make_engine
from rail.envs import ToolRunner, make_envs
from rail.learning import Absorption
from rail.evaluate import eval_metrics, evaluate, mean_over, overall, task_counts
from rail.policy_setup import RehearsalSource, checkpointing, make_policy
from rail.rounds import (Generation, Rounds, Start, Wait, derive_seed, drive_stream, intervention_metrics,
                         intervention_summary, make_group, make_menu, score, unguided_requests)
from rail.rundir import PARTIAL, RunError, RunLock, clear_partial, has_checkpoint, is_run_config, make_out
from rail.settings import settings_from
from rail.tracking import JsonlTracker, MlflowTracker, MultiTracker, NullTracker

log = logging.getLogger("rail")

#: the summary's ``time`` (seconds over the run): generating the base rollouts; the rounds' interventions and the
#: fill's fresh groups (generation only); scoring every rollout; the controller's own work (its decisions,
#: bookkeeping and learning); the learner's update; the held-out evaluations
TIMINGS = ("generate", "rounds", "score", "controller", "update", "eval")
#: a level whose unguided success at the start is below this is beyond reach: a group there almost never holds a
#: success, so plain GRPO gets no signal from it (the boundary probe's ``unguided`` target)
REACH = 0.05


def learner_settings(cfg: Config, **overrides) -> LearnerSettings:
    """The GRPO learner's settings: every ``[learner]`` field by name, and the rollout temperature and length
    (``overrides`` replace fields, e.g. ``schedule='constant'`` for a loop without a fixed number of steps)."""
    return settings_from(LearnerSettings, cfg.learner, **{"temperature": cfg.rollout.temperature,
                                                          "max_tokens": cfg.max_rollout_tokens, **overrides})


def task_mix(cfg: Config, step: int) -> tuple[list[str], list[int]]:
    """(families, levels) training tasks of ``step`` are drawn from: ``env.families`` and ``env.levels``, and from
    ``env.shift_step`` on (when set) ``env.shift_families`` / ``env.shift_levels`` where they are not empty. A
    function of the config and the step alone, so the draws of a step are the same however the run got there."""
    e = cfg.env
    if e.shift_step and step >= e.shift_step:
        return list(e.shift_families or e.families), list(e.shift_levels or e.levels)
    return list(e.families), list(e.levels)


def choice_metrics(groups) -> dict[str, float]:
    """What the controller chose per family and level this step (``choice/<family>/level_<L>/…``, from the step's
    groups after the rounds: base groups, refills and fill): ``groups``, ``intervened`` (groups with at least one
    intervention, probes included) and, per how@where that ran on a group of that cell, its decisions."""
    m: dict[str, float] = {}
    for g in groups:
        cell = f"choice/{g.family}/level_{int(g.task.level)}"
        m[f"{cell}/groups"] = m.get(f"{cell}/groups", 0.0) + 1.0
        m[f"{cell}/intervened"] = m.get(f"{cell}/intervened", 0.0) + float(bool(g.interventions))
        for key in g.interventions:
            m[f"{cell}/{key}"] = m.get(f"{cell}/{key}", 0.0) + 1.0
    return m


def note_choices(choices: dict, groups, step: int) -> None:
    """Add one step's choices to the run's record per family and level (``summary.json`` ``choices``, the
    summary's "what the controller learned"): ``steps`` maps the step to [groups, groups intervened on], ``help``
    maps each intervention's key (``how@where[:T]``) to [decisions, rollouts]."""
    for g in groups:
        c = choices.setdefault(f"{g.family} L{int(g.task.level)}", {"steps": {}, "help": {}})
        row = c["steps"].setdefault(str(step), [0, 0])
        row[0] += 1
        row[1] += int(bool(g.interventions))
        for key in g.interventions:
            c["help"].setdefault(key, [0, 0])[0] += 1
        for key in set(g.interventions):  # the rollouts of every decision of that key on the group, counted once
            c["help"][key][1] += sum(1 for t in g.trajectories if t.intervention and t.intervention.get("key") == key)


def _malformed(step) -> bool:
    """A turn that was not a call of a listed tool in the model's tool format, unless the environment took it as
    the end of the reply to a user message (``bfcl``: a turn without a call ends the user turn)."""
    return step.action is None and not (step.ok and (step.done or step.user is not None))


def _one(requests: list):
    """The step protocol of a single generation: the base batch."""
    gen = Generation(requests, ("base",), "base")
    yield Start(gen)
    return (yield Wait(gen))


def resolve_out(cfg: Config) -> Path:
    return Path(cfg.run.out or os.path.join("runs", cfg.run.name))


@dataclass
class RunState:
    step: int = 0
    wall_seconds: float = 0.0
    eval_initial: dict = field(default_factory=dict)
    eval_history: list = field(default_factory=list)
    quick_history: list = field(default_factory=list)  # the quick evaluations (eval.quick_every)
    mlflow_run_id: str | None = None
    tokens_per_rollout: float = 0.0  # running mean, for planning token budgets
    interventions: dict = field(default_factory=dict)  # how@where -> totals of STAT_KEYS over the run
    intervention_totals: dict = field(default_factory=dict)  # rescued / zero-variance group counts over the run
    tool_calls: dict = field(default_factory=dict)  # calls / failed / malformed, every rollout of the run
    errors: dict = field(default_factory=dict)  # reward / tool: verifier and tool failures over the run
    choices: dict = field(default_factory=dict)  # "family L<level>" -> what the controller chose there (note_choices)


class Trainer:
    def __init__(self, cfg: Config, out: Path, resume: bool = False, show_progress: bool = True):
        self.cfg, self.out, self.show_progress = cfg, out, show_progress
        self.t0 = time.perf_counter()
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        try:
            self.envs = make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)
            for env in self.envs.values():  # a finite pool (bfcl) may hold no task of env.levels: say so now
                env.sample_tasks(np.random.default_rng(0), cfg.env.levels, 1)
        except ValueError as e:  # e.g. an option value the environment refuses
            raise RunError(f"env.families / env.options / env.levels: {e}") from None
        if cfg.env.shift_step:  # the same for the mix trained after the shift, before anything is trained
            fams, levels = task_mix(cfg, cfg.env.shift_step)
            try:
                for fam in fams:
                    self.envs[fam].sample_tasks(np.random.default_rng(0), levels, 1)
            except ValueError as e:
                raise RunError(f"env.shift_families / env.shift_levels: {e}") from None
        self.runners = {f: ToolRunner(e, cfg.rollout.tool_format) for f, e in self.envs.items()}
        self.eval_counts = task_counts(self.envs, cfg)  # held-out tasks per row and level (pools may be finite)
        self.state = RunState()
        self.lock: RunLock | None = None  # the run directory's, when start_run / resume_run took it
        ckpt = None
        if resume:
            self.controller = CONTROLLERS[cfg.controller.name](config=cfg, out=out)
            ckpt, saved = self._pick_checkpoint()  # restores the controller, whose trace must cover it
            self.model, self.tokenizer = load_policy(ckpt / "model")  # with its LoRA adapters, if it has any
            checkpointing(self.model.to(resolve_device(cfg.run.device)), cfg)
            self.policy_info = {"source": f"checkpoint {ckpt}"}
        else:
            progress = self._ws_progress()
            try:
                self.model, self.tokenizer, self.policy_info = make_policy(cfg, self.envs, progress)
            finally:
                if progress is not None:
                    progress.close()
        self.renderer = ChatRenderer(self.tokenizer)
        self.engine = make_engine(cfg, self.model, self.renderer, out)
        self.rehearsal = RehearsalSource(self.renderer, self.envs, cfg) if cfg.learner.rehearsal > 0 else None
        learning = cfg.controller.name == "rail" and cfg.controller.reward == "learning"
        self.absorption = Absorption(cfg, self.envs, self.renderer) if learning else None
        self.learner = GRPOLearner(self.model, learner_settings(cfg), total_steps=cfg.run.steps,
                                   pad_id=self.renderer.pad, rehearsal_source=self.rehearsal)
        if not resume:
            self.controller = CONTROLLERS[cfg.controller.name](config=cfg, out=out)
        self.ledger = BudgetLedger(cfg.budget.unit, cfg.step_budget(), cfg.budget.total)
        if ckpt is not None:
            self._restore(ckpt, saved)
        self.params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p,
                                     cfg.rollout.max_tokens_per_turn, cfg.rollout.max_turns)
        self.tracker = self._trackers(resume)
        self.timings = dict.fromkeys(TIMINGS, 0.0)
        self._step_errors = {"reward": 0, "tool": 0}  # this step's verifier and tool failures
        self._warned_reward: set[str] = set()

    # ------------------------------------------------------------------ setup helpers
    def _ws_progress(self):
        if not self.show_progress or not self.cfg.warmstart.enabled:
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=self.cfg.warmstart.steps, desc="warm start", unit="step", leave=False)

        def cb(i, loss):
            if i >= bar.total:  # a cycle more, towards warmstart.target
                bar.total = i + max(1, self.cfg.warmstart.steps // 2)
                bar.refresh()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        cb.close = bar.close
        cb.say = lambda message: tqdm.write(f"rail: {message}")
        return cb

    def _trackers(self, resume: bool):
        jsonl = JsonlTracker(self.out / "metrics.jsonl", resume_step=self.state.step if resume else None)
        self.mlflow = None
        if not self.cfg.tracking.uri:
            return MultiTracker(jsonl, NullTracker())
        self.mlflow = ml = MlflowTracker(self.cfg.tracking.uri, self.cfg.tracking.experiment, self.cfg.run.name,
                           run_id=self.state.mlflow_run_id if resume else None,
                           parent_run_id=self.cfg.tracking.parent_run_id or None)
        self.state.mlflow_run_id = ml.run_id
        if not resume:
            ml.log_params(self.cfg.to_dict())
            ml.log_artifact(self.out / "config.json")
        return MultiTracker(jsonl, ml)

    def _pick_checkpoint(self) -> tuple[Path, dict]:
        """The newest checkpoint that verifies and whose controller state the trace on disk still covers; a
        damaged newer one is passed over with a warning (the steps after the one chosen are run again, drawing
        what they drew before)."""
        root = self.out / "checkpoints"
        remove_stale_temps(root)

        def accept(path: Path, saved: dict) -> None:
            try:
                self.controller.load_state_dict(saved.get("controller", {}))
            except TraceError as e:
                raise CheckpointError(f"{path}: its controller state does not match the trace ({e})") from None

        try:
            ckpt, saved, skipped = find_checkpoint(root, accept)
        except CheckpointError as e:
            raise CheckpointError(f"{e}. Remove {root} to start this run again from the beginning") from None
        for why in skipped:
            warnings.warn(f"{why}; resuming from {ckpt.name}", stacklevel=2)
        if skipped:  # readers (rail eval) follow the pointer: it names the checkpoint the run goes on from
            write_text_atomic(root / "latest", ckpt.name + "\n")
        return ckpt, saved

    def _restore(self, ckpt: Path, saved: dict) -> None:
        self.learner.load_state_dict(load_optimizer_state(ckpt))
        self.ledger.load_state_dict(saved["budget"])
        rs = saved["run"]
        self.state = RunState(step=int(saved["step"]), wall_seconds=float(rs["wall_seconds"]),
                              eval_initial=rs["eval_initial"], eval_history=rs["eval_history"],
                              quick_history=rs.get("quick_history", []),
                              mlflow_run_id=rs.get("mlflow_run_id"),
                              tokens_per_rollout=float(rs.get("tokens_per_rollout", 0.0)),
                              interventions=rs.get("interventions", {}),
                              intervention_totals=rs.get("intervention_totals", {}),
                              tool_calls=rs.get("tool_calls", {}), errors=rs.get("errors", {}),
                              choices=rs.get("choices", {}))
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
                    "eval_history": st.eval_history, "quick_history": st.quick_history,
                    "mlflow_run_id": st.mlflow_run_id,
                    "tokens_per_rollout": st.tokens_per_rollout, "interventions": st.interventions,
                    "intervention_totals": st.intervention_totals, "tool_calls": st.tool_calls,
                    "errors": st.errors, "choices": st.choices},
            "rng": {"python": [py[0], list(py[1]), py[2]], "torch": torch.get_rng_state().tolist()},
        }
        save_checkpoint(self.out / "checkpoints", st.step, self.model, self.tokenizer,
                        self.learner.state_dict(), state)

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # ------------------------------------------------------------------ one step
    def _sample_tasks(self, step: int, n_groups: int, stream: tuple = ()):
        """``n_groups`` training tasks of ``step``'s mix (:func:`task_mix`), from a stream that depends only on
        ``(run.seed, step, stream)``: a resumed run draws what the uninterrupted one drew, shift or not."""
        rng = np.random.default_rng([self.cfg.run.seed, step, 1, *stream])
        fams, levels = task_mix(self.cfg, step)
        out = []
        for g in range(n_groups):
            fam = fams[int(rng.integers(len(fams)))]
            (task,) = self.envs[fam].sample_tasks(rng, levels, 1)
            out.append((fam, task))
        return out

    def _score(self, trajs, tasks) -> None:
        def said(fam, task, why) -> None:  # reward 0 for that trajectory, counted; the first per family is said
            self._step_errors["reward"] += 1
            if fam not in self._warned_reward:
                self._warned_reward.add(fam)
                warnings.warn(f"environment '{fam}': the verifier {why} for task {task.id}; that trajectory "
                              "gets reward 0 and training goes on (counted as errors/reward)", stacklevel=3)

        score(trajs, tasks, self.envs, said)

    def step(self, step: int) -> dict[str, float]:
        """One training step (module docstring). Its rollouts — base groups, the controller's rounds, the fill —
        run in one rollout stream: the base batch first, then each round's interventions and the fill join the
        running batch as soon as they are decided (:func:`rail.rounds.drive_stream`)."""
        cfg, g = self.cfg, self.cfg.budget.group_size
        self._step_errors = {"reward": 0, "tool": 0}
        budget = self.ledger.open_step()
        t0 = t = time.perf_counter()
        per_rollout = self.state.tokens_per_rollout or cfg.max_rollout_tokens / 4
        n_groups = self.controller.plan_base(budget.limit, g, cfg.budget.unit, tokens_per_rollout=per_rollout)
        tasks = self._sample_tasks(step, n_groups)
        requests = lambda idx, k: unguided_requests(tasks, idx, k, self.envs, self.runners)  # noqa: E731
        cap = budget.remaining if cfg.budget.unit == "tokens" else None
        with self.engine.stream(self.params, derive_seed(cfg.run.seed, step, 2), max_new_tokens=cap) as stream:
            trajs = drive_stream(_one(requests(range(n_groups), g)), stream, lambda ended: None)
            budget.charge("base", cost_of(trajs, cfg.budget.unit))
            t_gen = time.perf_counter() - t

            t_score = 0.0

            def scored(ended, tasks=tasks) -> None:
                nonlocal t_score
                t = time.perf_counter()
                self._score(ended, tasks)
                t_score += time.perf_counter() - t

            scored(trajs)
            t = time.perf_counter()
            groups = [make_group(i, fam, task, trajs) for i, (fam, task) in enumerate(tasks)]
            self.controller.begin_step(step, cfg.run.steps, budget, np.random.default_rng([cfg.run.seed, step, 4]))
            t_ctl = time.perf_counter() - t
            rounds = Rounds(self.controller, groups, tasks, make_menu(cfg, self.envs, self.runners, per_rollout),
                            budget, max_rounds=cfg.controller.max_rounds, group_size=g, base_requests=requests,
                            new_tasks=lambda n, stream: self._sample_tasks(step, n, stream),
                            tokens_per_rollout=per_rollout)
            score_before = t_score
            outcomes = drive_stream(rounds.protocol(), stream, scored)
        all_trajs = trajs + rounds.trajectories
        t_rollouts = time.perf_counter() - t0  # every rollout of the step: base, rounds and fill, scored
        # the rounds' and the fill's generation: what they took less the controller's own time and the scoring
        t_ctl += rounds.controller_seconds
        t_rounds = time.perf_counter() - t - t_ctl - (t_score - score_before)

        t = time.perf_counter()
        compose = compose_of(cfg)
        batch = self.learner.prepare(all_trajs, compose=compose)
        t_fb = time.perf_counter()
        absorbed = self.absorption(self.learner, batch, groups, outcomes) if self.absorption is not None else None
        self.controller.feedback(groups, outcomes, compose, absorbed)
        t_fb = time.perf_counter() - t_fb
        t_ctl += t_fb
        if self.rehearsal is not None:
            self.rehearsal.begin_step(step)
        upd = self.learner.update(batch, torch.Generator().manual_seed(derive_seed(cfg.run.seed, step, 3)))
        sync = getattr(self.engine, "sync_weights", None)
        if sync is not None and not upd.get("skipped"):
            sync(self.model)  # an engine with its own copy of the weights (vLLM) samples the next step from these
        t_upd = time.perf_counter() - t - t_fb

        trajs = all_trajs
        base = [tr for tr in trajs if tr.intervention is None]
        n_gen = [tr.n_generated for tr in base]
        if n_gen:
            self.state.tokens_per_rollout = float(np.mean(n_gen))
        calls = [tr.tool_calls() for tr in base]
        n_calls = sum(c for c, _ in calls)
        tc = self.state.tool_calls
        for tr in all_trajs:
            c, f = tr.tool_calls()
            tc["calls"] = tc.get("calls", 0) + c
            tc["failed"] = tc.get("failed", 0) + f
            tc["malformed"] = tc.get("malformed", 0) + sum(1 for st in tr.steps if _malformed(st))
            self._step_errors["tool"] += sum(1 for st in tr.steps if st.error)
        for k, v in self._step_errors.items():
            self.state.errors[k] = self.state.errors.get(k, 0) + v
        rewards = np.array([tr.reward for tr in base])
        m = {
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/success_rate": float(np.mean([succeeded(r) for r in rewards])),
            "rollout/tokens_mean": float(np.mean(n_gen)),
            "rollout/turns_mean": float(np.mean([tr.n_turns for tr in base])),
            "rollout/truncated_share": float(np.mean([tr.truncated for tr in base])),
            "rollout/tool_failure_rate": (sum(f for _, f in calls) / n_calls) if n_calls else 0.0,
            "rollout/rubric_progress": float(np.mean([tr.rubric.progress for tr in base])),
            "rollout/count": float(len(base)),
            "groups/count": batch.stats["groups"],
            "groups/zero_variance_share": batch.stats["zero_variance_share"],
            "groups/all_tools_failed_trajectories": batch.stats["all_tools_failed"],
            "groups/trained_trajectories": batch.stats["kept"],
            "shift/measured": batch.stats["shift_measured"],
            "shift/accepted": batch.stats["shift_accepted"],
            "shift/rejected": batch.stats["shift_rejected"],
            "shift/mean": batch.stats["shift_mean"],
            "shift/max": batch.stats["shift_max"],
            "shift/replayed": batch.stats["guided_replay"],
            "rollout/malformed_calls": float(sum(1 for tr in base for st in tr.steps if _malformed(st))),
            "errors/reward": float(self._step_errors["reward"]),
            "errors/tool": float(self._step_errors["tool"]),
            "time/generate_s": t_gen, "time/rounds_s": t_rounds, "time/score_s": t_score, "time/controller_s": t_ctl,
            "time/update_s": t_upd, "time/rollouts_s": t_rollouts,
        }
        m.update(self._intervention_metrics(groups, outcomes, budget))
        m.update(self.controller.metrics())
        m.update({f"loss/{k}": v for k, v in upd.items()})
        m.update({f"tis/{k[4:]}": v for k, v in batch.stats.items() if k.startswith("tis_")})
        m.update(self.ledger.close_step(budget))
        for k, v in (("generate", t_gen), ("rounds", t_rounds), ("score", t_score), ("controller", t_ctl),
                     ("update", t_upd)):
            self.timings[k] += v
        return m

    def _intervention_metrics(self, groups: list, outcomes: list, budget) -> dict[str, float]:
        share = budget.spent["intervention"] / budget.limit if budget.limit else 0.0
        m = intervention_metrics(groups, outcomes, share, self.state.interventions, self.state.intervention_totals)
        m.update(choice_metrics(groups))
        note_choices(self.state.choices, groups, self.state.step + 1)
        return m

    # ------------------------------------------------------------------ run
    def _evaluate(self, step: int) -> dict:
        t = time.perf_counter()
        # one seed for every evaluation (common random numbers): differences between evaluations are the policy's
        res = evaluate(self.engine, self.envs, self.cfg, seed=derive_seed(self.cfg.run.seed, 10_000))
        self.timings["eval"] += time.perf_counter() - t
        self.state.eval_history.append({"step": step, "budget_spent": self.ledger.used, "success": res})
        self.tracker.log_metrics({**eval_metrics(res, self.eval_counts),
                                  "eval/easy_mean": mean_over(res, self.cfg.warmstart.levels),
                                  "budget/spent_total": float(self.ledger.used)}, step)
        return res

    def _quick_evaluate(self, step: int) -> None:
        """A quick evaluation (``eval.quick_every``): the first ``eval.quick_tasks`` held-out tasks of each family
        and level, sampled as the full evaluation samples them, under its own seed."""
        t = time.perf_counter()
        c = copy.deepcopy(self.cfg)
        c.eval.tasks_per_level = min(c.eval.quick_tasks, c.eval.tasks_per_level)
        res = evaluate(self.engine, self.envs, c, seed=derive_seed(self.cfg.run.seed, 10_001))
        self.timings["eval"] += time.perf_counter() - t
        self.state.quick_history.append({"step": step, "budget_spent": self.ledger.used, "success": res})
        levels = [lv for lv in self.cfg.eval.levels if lv not in self.cfg.warmstart.levels]
        self.tracker.log_metrics({**{f"quick/{fam}/level_{lv}": v for fam, rates in res.items()
                                     for lv, v in rates.items()},
                                  "quick/easy_mean": mean_over(res, self.cfg.warmstart.levels),
                                  **({"quick/beyond_mean": mean_over(res, levels)} if levels else {})}, step)

    def run(self) -> dict:
        """Train to ``run.steps`` (or ``budget.total``), evaluate, write ``summary.json``; the run directory's
        lock is released however it ends."""
        try:
            return self._run()
        finally:
            if self.lock is not None:
                self.lock.release()

    def _run(self) -> dict:
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
                elif cfg.eval.quick_every and step % cfg.eval.quick_every == 0 and step < cfg.run.steps:
                    self._quick_evaluate(step)
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
            close_engine(self.engine)
            if status != "FINISHED":
                self.tracker.close("FAILED")
        summary = self.summary()
        write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=1, sort_keys=True))
        iv = summary["interventions"]
        self.tracker.log_metrics({"summary/wall_seconds": summary["wall_seconds"],
                                  "summary/intervention_budget_share": iv["budget_share"],
                                  "summary/intervention_success_rate": iv["success_rate"],
                                  "summary/shift_acceptance_rate": iv["acceptance_rate"],
                                  "summary/rescue_rate": iv["rescue_rate"],
                                  "summary/easy_final": summary["eval"]["easy_final"],
                                  "summary/beyond_final": summary["eval"]["beyond_final"]}, self.state.step)
        self.tracker.log_artifact(self.out / "summary.json")
        self.tracker.close("FINISHED")
        return summary

    def summary(self) -> dict:
        cfg, st = self.cfg, self.state
        initial, final = st.eval_initial, st.eval_history[-1]["success"]
        boundary = {fam: {"within_reach_at_start": [int(lv) for lv, v in rates.items() if v >= REACH],
                          "beyond_reach_at_start": [int(lv) for lv, v in rates.items() if v < REACH]}
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
            "eval": {"initial": initial, "final": final, "history": st.eval_history, "quick": st.quick_history,
                     "tasks": self.eval_counts, "overall_initial": overall(initial, self.eval_counts),
                     "overall_final": overall(final, self.eval_counts),
                     "easy_levels": easy, "beyond_levels": beyond,
                     "easy_initial": mean_over(initial, easy), "easy_final": mean_over(final, easy),
                     "beyond_initial": mean_over(initial, beyond), "beyond_final": mean_over(final, beyond)},
            "boundary": boundary,
            "interventions": self._intervention_summary(),
            "tool_calls": {k: int(v) for k, v in st.tool_calls.items()},
            "errors": {k: int(st.errors.get(k, 0)) for k in ("reward", "tool")},
            "controller_state": self.controller.summary(),
            "tracking": {"uri": cfg.tracking.uri,
                         "status": "off" if self.mlflow is None else "ok" if self.mlflow.ok else "failed",
                         "error": None if self.mlflow is None else self.mlflow.error},
            "choices": st.choices,
            "time": {k: round(v, 3) for k, v in self.timings.items()},
        }


    def _intervention_summary(self) -> dict:
        spent = self.ledger.spent
        return intervention_summary(self.state.interventions, self.state.intervention_totals, spent["base"],
                                    spent["intervention"])


def start_run(cfg: Config, show_progress: bool = True) -> tuple[Trainer, Path]:
    """A new run in ``run.out``: refused when the directory holds a run with a checkpoint or a summary (resume
    it instead) or another process is in it; a run there that was stopped before its first checkpoint has
    nothing finished, so it is replaced."""
    out = resolve_out(cfg)
    created = make_out(out)
    lock = RunLock(out)
    try:
        if (out / "config.json").exists():
            if (out / "summary.json").exists() or has_checkpoint(out):
                raise RunError(f"{out} already holds a run; continue it with `rail resume {out}` "
                               "or choose another --out")
            if not is_run_config(out / "config.json"):
                raise RunError(f"{out}: holds a config.json that is not a rail run's; choose another --out")
            clear_partial(out, "holds a run stopped before its first checkpoint")
        write_text_atomic(out / "config.json", json.dumps(cfg.to_dict(), indent=1))
    except BaseException:
        lock.release()
        raise
    try:
        trainer = Trainer(cfg, out, show_progress=show_progress)
    except BaseException:
        lock.release()
        if not has_checkpoint(out):  # nothing worth keeping yet
            import shutil
            if created:
                shutil.rmtree(out, ignore_errors=True)
            else:
                for name in ("config.json", *PARTIAL):
                    p = out / name
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        raise
    trainer.lock = lock
    return trainer, out


def read_run_config(run_dir: Path) -> Config:
    """The config a run was started with (its ``config.json``); a clear error naming the file when it is damaged."""
    cpath = Path(run_dir) / "config.json"
    raw = read_json(cpath, fix="the run's configuration is damaged; restore the file, or start a new run "
                               "with another --out")
    cfg = merge(Config(), raw, str(cpath))
    validate(cfg)
    return cfg


def resume_run(out: Path, show_progress: bool = True) -> tuple[Trainer, Path]:
    """Continue the run in ``out`` from its newest usable checkpoint; a run stopped before its first checkpoint
    starts again from the beginning with its own config (nothing of it was finished)."""
    out = Path(out)
    if not (out / "config.json").is_file():
        raise RunError(f"{out}: no config.json; not a rail run directory")
    lock = RunLock(out)
    try:
        cfg = read_run_config(out)
        if has_checkpoint(out):
            trainer = Trainer(cfg, out, resume=True, show_progress=show_progress)
        else:
            clear_partial(out, "no checkpoint yet (the run was stopped before its first one)")
            trainer = Trainer(cfg, out, show_progress=show_progress)
    except BaseException:
        lock.release()
        raise
    trainer.lock = lock
    return trainer, out


def resolve_checkpoint(path: Path) -> tuple[Path, Config]:
    """(checkpoint directory, the run's config) for a run directory (its newest usable checkpoint) or a
    checkpoint directory inside one; the checkpoint's checksums are verified."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        run_dir = path
        ckpt, _, skipped = find_checkpoint(path / "checkpoints")
        for why in skipped:
            warnings.warn(f"{why}; evaluating {ckpt.name}", stacklevel=2)
    elif (path / "manifest.json").exists() or (path / "model").is_dir():
        run_dir, ckpt = path.parent.parent, path
        verify_checkpoint(ckpt)
    else:
        raise RunError(f"{path}: neither a run directory nor a checkpoint directory")
    return ckpt, read_run_config(run_dir)


def eval_checkpoint(path: Path, tasks_per_level: int | None = None, temperature: float | None = None) -> dict:
    """Evaluate a checkpoint (a run directory, or a checkpoint directory inside one) on the held-out tasks."""
    ckpt, cfg = resolve_checkpoint(path)
    if tasks_per_level is not None:
        cfg.eval.tasks_per_level = tasks_per_level
    if temperature is not None:
        cfg.eval.temperature = temperature
    validate(cfg)
    model, tok = load_policy(ckpt / "model")
    envs = make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)
    engine = make_engine(cfg, model.to(resolve_device(cfg.run.device)), ChatRenderer(tok), None)
    try:
        return evaluate(engine, envs, cfg, seed=derive_seed(cfg.run.seed, 99_999))
    finally:
        close_engine(engine)
