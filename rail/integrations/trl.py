"""rail's interventions and learned controller inside TRL's ``GRPOTrainer`` (``pip install -e ".[trl]"``, trl 1.16).

What a TRL user adds to their own script (``experiments/trl_grpo.py`` is a complete one; docs/integrations.md):

    rail = RailTRL(cfg)                                    # rail's Config: environments, tool format, controller, menu
    trainer = GRPOTrainer(model, reward_funcs=rail.reward, args=GRPOConfig(..., num_generations=8),
                          train_dataset=rail.dataset(256), processing_class=tokenizer,
                          rollout_func=rail.rollout_func, callbacks=[rail.callback])
    trainer.train()                                        # or train(resume_from_checkpoint=...)
    print(rail.report())

This module only translates. Each call of ``rollout_func(prompts, trainer)`` is one rail step over the
process's groups (TRL hands every prompt ``num_generations`` times in a row):

1. **slots** (:mod:`rail.integrations.slots`, shared with the verl adapter). Every group has ``num_generations``
   slots. ``controller.base_share`` of them (all of them for ``controller.name = "none"``) get base rollouts
   first; the rest are the group's ``capacity`` for interventions, and the step's budget is the sum of the free
   slots. The controller's rounds (the ``decide`` / ``observe`` / ``feedback`` protocol of ``rail.controllers``
   that rail's own training loop drives, so the learned controller goes through ``controller.Session`` as in
   ``rail train``) fill free slots of failed groups with intervened rollouts planned by
   :func:`rail.interventions.plan`; whatever the rounds leave is filled with more base rollouts of the same
   prompt. A returned group has exactly ``num_generations`` members.
2. **multi-turn and interventions** run on rail's engine (``policy.engine``, ``rollout.engine``) over the
   trainer's own model, with rail's environments and tool-call format: branching from a prefix of a failed
   rollout, hints and plans need an engine that can start from a prefix and mark guidance, which TRL's tool loop
   cannot.
3. **guidance stripped.** ``prompt_ids`` is the prompt without guidance (``Trajectory.training_view``); hint and
   plan tokens are never in ``prompt_ids`` or ``completion_ids``; tool observations and injected reference
   steps are in ``completion_ids`` with ``env_mask`` 0; ``logprobs`` are the behaviour log-probs each token was
   sampled with, under the guided context. TRL reads them only for its vLLM importance-sampling correction
   (``use_vllm`` with ``vllm_importance_sampling_correction``) and its off-policy sequence mask
   (``off_policy_mask_threshold``); docs/integrations.md says what that does to guided rollouts.
4. **the shift filter** (``learner.shift_threshold``, rail's learner's rule, :func:`policy.learner.shift_measures`)
   measures every rollout sampled under a hint or plan with the trainer's current weights; one above the
   threshold gets reward ``None`` from :attr:`RailTRL.reward`, which TRL treats as unscorable (out of the group
   baseline, advantage 0), and teaches the controller nothing, as in rail.
5. **checkpoints.** :attr:`RailTRL.callback` writes the controller's state beside every TRL checkpoint
   (``checkpoint-N/rail_controller.json``) and restores it when ``train(resume_from_checkpoint=...)`` resumes;
   the trace (``<output_dir>/rail/traces/decisions.dsjson``) is cut back to the events that state had learned.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from transformers import TrainerCallback

from policy.engine import SamplingParams
from policy.fileio import write_text_atomic
from policy.learner import shift_measures
from policy.records import Status
from policy.tokenizer import ChatRenderer
from rail.config import Config
from rail.integrations.slots import Slots, check, run_sync
from rail.engines import close_engine, make_engine
from rail.rounds import derive_seed, score
from rail.rundir import RunError

log = logging.getLogger("rail")

#: the file beside each TRL checkpoint that holds the adapter's state
STATE_FILE = "rail_controller.json"
TRAINER = "GRPOTrainer"


class RailTRL:
    """``rollout_func``, ``reward`` and ``callback`` for one ``GRPOTrainer`` run, over rail's config ``cfg``.

    Read from ``cfg``: ``env`` (tasks), ``rollout`` (engine, tool format, turns, tokens per turn), ``controller``
    (which controller, ``base_share``, the menu and every learned-controller setting) and
    ``learner.shift_threshold``. Taken from the trainer instead: the group size (``num_generations``), the seed,
    the sampling temperature and top-p, and the number of steps; the budget is counted in rollouts (slots).
    """

    def __init__(self, cfg: Config | None = None):
        self.cfg = copy.deepcopy(cfg) if cfg is not None else Config()
        check(self.cfg, TRAINER)
        from rail.envs import make_envs

        self.envs = make_envs(self.cfg.env.families, self.cfg.env.seed, self.cfg.env.options)
        self.tasks: dict[tuple[str, str], tuple[str, Any]] = {}  # (system, user) message -> (family, task)
        self.slots: Slots | None = None  # made by the callback when training begins
        self.callback = _Callback(self)
        self.last: dict[str, float] = {}  # the last step's metrics, logged through the reward function
        self.out: Path | None = None
        self._state_name = STATE_FILE
        self._engine = self._engine_model = self._renderer = None
        self._synced_step = -1
        self.reward = self._make_reward()

    @property
    def controller(self):
        return None if self.slots is None else self.slots.controller

    @property
    def runners(self) -> dict:
        return self.slots.runners

    # ------------------------------------------------------------------ the dataset
    def dataset(self, n: int, seed: int | None = None):
        """``n`` training tasks of ``env.families`` at ``env.levels`` (families uniformly, as ``rail train`` draws
        them) as a ``datasets.Dataset`` with a conversational ``prompt`` (system and user message) and the task's
        ``family``, ``level`` and ``task_id`` columns (reward functions receive them). ``rollout_func`` finds the
        task again from its prompt."""
        import datasets

        rng = np.random.default_rng([self.cfg.run.seed if seed is None else seed, 7])
        fams, rows = self.cfg.env.families, []
        while len(rows) < n:
            fam = fams[int(rng.integers(len(fams)))]
            (task,) = self.envs[fam].sample_tasks(rng, self.cfg.env.levels, 1)
            key = (self.envs[fam].system_prompt(), task.prompt)
            known = self.tasks.setdefault(key, (fam, task))
            if known[1].id != task.id:  # two tasks behind one prompt: keep the first, draw again
                continue
            rows.append({"prompt": [{"role": "system", "content": key[0]}, {"role": "user", "content": key[1]}],
                         "family": fam, "level": task.level, "task_id": task.id})
        return datasets.Dataset.from_list(rows)

    def _groups_of(self, prompts: list, g: int) -> list[tuple[str, Any]]:
        """(family, task) of each group of ``g`` identical consecutive prompts."""
        if len(prompts) % g:
            raise RunError(f"rollout_func got {len(prompts)} prompts, not whole groups of num_generations = {g}: "
                           "make per_device_train_batch_size x steps_per_generation a multiple of num_generations")
        out = []
        for i in range(0, len(prompts), g):
            p = prompts[i]
            if any(q != p for q in prompts[i:i + g]):
                raise RunError(f"rollout_func: prompts {i}..{i + g - 1} are not one prompt repeated num_generations "
                               "times; the process holds part of a group (make per_device_train_batch_size a "
                               "multiple of num_generations)")
            key = _prompt_key(p)
            if key not in self.tasks:
                raise RunError(f"rollout_func: a prompt that RailTRL.dataset() did not make ({str(p)[:80]!r}); "
                               "train on RailTRL.dataset(n)")
            out.append(self.tasks[key])
        return out

    # ------------------------------------------------------------------ one generation
    def rollout_func(self, prompts: list, trainer) -> dict[str, list]:
        """TRL's ``rollout_func``: ``num_generations`` completions per prompt, one rail step (module docstring)."""
        if self.slots is None:
            raise RunError("RailTRL.rollout_func was called before training began: pass callbacks=[rail.callback] "
                           "to GRPOTrainer (it makes the controller and keeps its state with TRL's checkpoints)")
        training = trainer.model.training
        g = trainer.num_generations if training else trainer.num_generations_eval
        tasks = self._groups_of(prompts, g)
        engine = self._engine_for(trainer)
        args = trainer.args
        params = SamplingParams(args.temperature, args.top_p if args.top_p is not None else 1.0,
                                self.cfg.rollout.max_tokens_per_turn, self.cfg.rollout.max_turns)
        slots = self.slots
        if not training:  # evaluation: plain rollouts, no controller
            trajs = engine.generate(slots.requests(tasks, range(len(tasks)), g), params,
                                    seed=derive_seed(args.seed, 10_000 + slots.calls))
            score(trajs, tasks, slots.envs)
            return _trl_batch([[t for t in trajs if t.group == i] for i in range(len(tasks))], g)

        call = slots.calls + 1
        codes = {"base": (2,), "round": (5,), "fill": (6,)}

        async def generate(requests, key):
            trajs = engine.generate(requests, params, seed=derive_seed(args.seed, call, *codes[key[0]], *key[1:]))
            score(trajs, tasks, slots.envs)
            return trajs

        views, ran, groups = run_sync(slots.step(tasks, trainer.state.global_step, trainer.state.max_steps,
                                                    args.seed, generate))
        self.last = slots.finish(views, ran, groups, shift_of=self._shift_of(trainer))
        return _trl_batch(groups, g)

    def _shift_of(self, trainer):
        """rail's shift measure (:func:`policy.learner.shift_measures`) under the trainer's current weights, for the
        learner's shift filter (``learner.shift_threshold``) on the rollouts sampled under a hint or plan."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        return lambda trajs: shift_measures(model, trajs, self._renderer.pad, trainer.args.temperature,
                                            self.cfg.rollout.batch_size)

    def _engine_for(self, trainer):
        """rail's engine (``rollout.engine``) over the trainer's model, synced after each optimizer step when it
        keeps its own copy of the weights (vLLM)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self._engine is None or self._engine_model is not model:
            if self._engine is not None:
                close_engine(self._engine)
            self._renderer = ChatRenderer(trainer.processing_class)
            self._engine = make_engine(self.cfg, model, self._renderer, (self.out or Path(".")) / "engine")
            self._engine_model, self._synced_step = model, trainer.state.global_step
        sync = getattr(self._engine, "sync_weights", None)
        if sync is not None and trainer.state.global_step != self._synced_step:
            sync(model)
            self._synced_step = trainer.state.global_step
        return self._engine

    # ------------------------------------------------------------------ reward, state, report
    def _make_reward(self):
        owner = self

        def rail_reward(completions, rail_reward, rail_accepted, log_metric=None, **_):
            """The environment's verifier reward of each completion (computed by ``rollout_func``); ``None`` for a
            rollout the shift filter rejected. Logs the adapter's metrics once per generation."""
            if log_metric is not None and owner.last:
                for k, v in owner.last.items():
                    log_metric(k, v)
                owner.last = {}
            return [r if a else None for r, a in zip(rail_reward, rail_accepted)]

        return rail_reward

    def begin(self, output_dir: str | Path, seed: int, num_generations: int, global_step: int, process: int = 0,
              processes: int = 1) -> None:
        """Make the controller for a run writing to ``output_dir`` (the callback calls it when training begins; at
        ``global_step`` > 0 it restores the state saved beside ``checkpoint-<global_step>``)."""
        cfg = copy.deepcopy(self.cfg)
        cfg.run.seed = int(seed)
        self.out = Path(output_dir) / "rail" / (f"rank{process}" if processes > 1 else "")
        self._state_name = STATE_FILE if processes == 1 else f"rail_controller-rank{process}.json"
        trace = self.out / "traces" / "decisions.dsjson"
        if global_step == 0 and trace.exists():
            log.warning("%s: a fresh run replaces the trace of the run before it", trace)
            trace.unlink()
        self.slots = Slots(cfg, num_generations, self.out, TRAINER, envs=self.envs)
        if global_step > 0:
            path = Path(output_dir) / f"checkpoint-{global_step}" / self._state_name
            try:
                saved = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise RunError(f"resuming at step {global_step}: {path} cannot be read ({e}); the controller's state "
                               "is written there by RailTRL.callback: resume from a checkpoint of a run that had it, "
                               "under the same output_dir") from None
            self.slots.load_state_dict(saved)

    def save(self, checkpoint_dir: str | Path) -> None:
        """The adapter's state beside a TRL checkpoint (between generations: the controller's step has ended)."""
        write_text_atomic(Path(checkpoint_dir) / self._state_name, json.dumps(self.slots.state_dict()))

    @property
    def calls(self) -> int:
        return 0 if self.slots is None else self.slots.calls

    def summary(self) -> dict:
        return self.slots.summary() if self.slots is not None else {}

    def report(self) -> str:
        return self.slots.report(TRAINER) if self.slots is not None else ""


class _Callback(TrainerCallback):
    """Makes the controller when training begins (restoring it on resume) and saves it with every checkpoint."""

    def __init__(self, owner: RailTRL):
        self.owner = owner

    def on_train_begin(self, args, state, control, **kwargs):
        self.owner.begin(args.output_dir, args.seed, args.num_generations, state.global_step,
                         args.process_index, args.world_size)

    def on_save(self, args, state, control, **kwargs):
        self.owner.save(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        if self.owner._engine is not None:
            close_engine(self.owner._engine)
            self.owner._engine = self.owner._engine_model = None


def _prompt_key(prompt) -> tuple[str, str]:
    """(system, user) of a conversational prompt as RailTRL.dataset() writes it."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        system = next((m.get("content", "") for m in prompt if m.get("role") == "system"), "")
        return str(system), str(prompt[-1].get("content", ""))
    return "", str(prompt)


def _trl_batch(slots: list[list], g: int) -> dict[str, list]:
    """TRL's rollout_func output, group after group: the training view of each rollout (guidance stripped) split
    at its prompt; ``env_mask`` 1 on the tokens the policy sampled; the rollout's reward and kind for the reward
    function."""
    out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "rail_reward",
                                            "rail_accepted", "rail_intervention")}
    for members in slots:
        if len(members) != g:
            raise AssertionError(f"a group of {len(members)} rollouts for {g} slots")
        for t in members:
            ids, mask, lps, _, _ = t.training_view()
            p = len(t.context_prompt_ids)
            out["prompt_ids"].append(ids[:p])
            out["completion_ids"].append(ids[p:])
            out["logprobs"].append(lps[p:])
            out["env_mask"].append(mask[p:])
            out["rail_reward"].append(float(t.reward))
            out["rail_accepted"].append(Status(t.status).joined)
            out["rail_intervention"].append(t.intervention["key"] if t.intervention else "")
    return out
