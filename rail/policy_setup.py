"""Building the policy: vocabulary, the built-in tiny model, the warm start and its on-disk cache.

The warm start is supervised fine-tuning on reference trajectories (the action guide executed in the
environment, rendered in the model's chat template and tool-call format) of the easy levels only; it works for
the built-in model and for any checkpoint (``model.path``). It gives the base policy a capability boundary: it solves the easy
levels part of the time and almost never the hard ones. Warm-started models are cached under
``warmstart.cache_dir`` keyed by a hash of everything that determines them, the demonstrations included.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from policy.fileio import write_text_atomic
from policy.learner import sft_backward
from policy.lora import merged
from policy.model import build_tiny_model, load_policy, load_tokenizer, resolve_device, save_policy
from policy.records import Origin, Trajectory
from policy.tokenizer import ChatRenderer, build_word_tokenizer
from rail.config import Config
from rail.envs import Action, Environment, ToolRunner, rubric_status

log = logging.getLogger("rail")
CACHE_VERSION = "5"  # bump when the warm-start procedure changes


def vocabulary(envs: dict[str, Environment]) -> list[str]:
    from rail.interventions import GUIDANCE_WORDS

    words: set[str] = set(GUIDANCE_WORDS)
    for env in envs.values():
        words.update(env.vocabulary())
    return sorted(words)


def demonstration_task(env: Environment, rng: np.random.Generator, levels, guided: bool):
    """The environment's task for a warm-start demonstration of ``levels``; a training task by default (the
    protocol makes ``demonstration_task`` optional)."""
    own = getattr(env, "demonstration_task", None)
    if own is not None:
        return own(rng, levels, guided)
    (task,) = env.sample_tasks(rng, levels, 1)
    return task


def demonstration(task, rng: np.random.Generator, noise: float, alternatives: dict[str, list[str]]) -> list[Action]:
    """The actions of one warm-start demonstration: the action guide, or with probability ``noise`` an
    imperfect demonstrator's version of it.

    The imperfect demonstrator gets one call wrong (its second argument, e.g. the relation or the operator,
    replaced by the value it is confused with: the next one in ``alternatives``) and then carries on
    consistently: every later call starts from what the previous call returned and the answer is the last
    result. Because each value has one fixed confusion partner, the mistake is systematic: a policy imitating
    a mixture of such demonstrators puts a large share of probability on one plausible wrong value, a mistake
    that survives low sampling temperatures and that reward can correct.
    """
    guide = list(task.action_guide)
    calls = [i for i, a in enumerate(guide) if len(a.args) >= 2 and len(alternatives.get(a.tool, [])) > 1]
    if not calls or rng.random() >= noise:
        return guide
    k = calls[int(rng.integers(len(calls)))]
    a = guide[k]
    values = alternatives[a.tool]
    wrong = values[(values.index(a.args[1]) + 1) % len(values)] if a.args[1] in values else values[0]
    guide[k] = Action(a.tool, (a.args[0], wrong, *a.args[2:]))
    return guide


def reference_trajectory(env: Environment, task, renderer: ChatRenderer, group: int = 0,
                         actions: list[Action] | None = None, plan: str | None = None,
                         hint: tuple[int, str] | None = None, tool_format: str = "builtin") -> Trajectory:
    """``actions`` (default: the action guide) executed turn by turn, tokenised as if the policy wrote them.

    When ``actions`` differ from the guide (a perturbed demonstration), later calls chain from the actual result
    (their first argument) and the answer is the last result, so the demonstration stays consistent.
    ``plan`` is appended to the user message and ``hint = (turn, text)`` is a user message before that turn,
    both kept as (untrained) context: a demonstration of following guidance. Calls are written in
    ``tool_format`` and the prompt lists the task's tools, as the engine renders them; a turn the environment
    answers with its next user message is followed by that message.
    """
    runner = ToolRunner(env, tool_format).begin(task)
    user = task.prompt if plan is None else f"{task.prompt} {plan}"
    if hint is not None and hint[0] == 0:
        prompt, _ = renderer.prompt_with_hint(env.system_prompt(), user, hint[1], runner.tools, runner.describes_tools)
    else:
        prompt = renderer.prompt(env.system_prompt(), user, runner.tools, runner.describes_tools)
    tr = Trajectory(task.id, task.family, task.level, group, prompt, list(prompt))
    guide = list(task.action_guide if actions is None else actions)
    perturbed = actions is not None and guide != list(task.action_guide)
    last_obs = None
    for t, action in enumerate(guide):
        if perturbed and last_obs is not None:
            if action.tool == "answer":
                action = Action("answer", (last_obs,))
            elif action.args:
                action = Action(action.tool, (last_obs, *action.args[1:]))
        text = runner.render(action)
        for tok in [*renderer.encode_turn(text), renderer.end_of_turn]:
            tr.ids.append(tok), tr.origin.append(Origin.POLICY), tr.logprobs.append(0.0), tr.turn.append(t)
        step = runner.step(task, text)
        last_obs = step.observation if step.ok and not step.done else last_obs
        tr.steps.append(step)
        tr.turn_texts.append(text)
        if step.done:
            tr.done = True
            break
        if hint is not None and hint[0] == t + 1:
            suffix = renderer.tool_suffix_with_hint(step.observation, hint[1], step.user)[0]
        else:
            suffix = renderer.tool_suffix(step.observation, step.user)
        for tok in suffix:
            tr.ids.append(tok), tr.origin.append(Origin.TOOL), tr.logprobs.append(0.0), tr.turn.append(t)
    tr.reward = env.reward(task, tr.steps)
    tr.rubric = rubric_status(env, task, tr.steps)
    return tr


def guided_demonstration(env: Environment, task, renderer: ChatRenderer, rng: np.random.Generator,
                         tool_format: str = "builtin") -> Trajectory:
    """A clean demonstration that follows guidance in its context: half the time a plan listing the first m
    reference actions (m uniform), otherwise a hint with the evidence of rubric item k before the turn that
    achieves it (k uniform). It teaches the built-in model to read the guidance the interventions give; a
    pretrained instruct model reads hints without this. A task of level 0 (``kin``'s nonce names, whose
    knowledge only the guidance gives) gets complete guidance: every call in the plan, the hint before the
    first turn, so no demonstration shows a guess."""
    from rail.interventions import guide_start, hint_text, plan_text

    n = len(task.action_guide)
    complete = task.level == 0
    inline = ToolRunner(env, tool_format).inline
    if rng.random() < 0.5:
        return reference_trajectory(env, task, renderer, tool_format=tool_format,
                                    plan=plan_text(task, n if complete else int(rng.integers(1, n + 1)), inline))
    k = 0 if complete else int(rng.integers(len(task.rubric)))
    return reference_trajectory(env, task, renderer, hint=(guide_start(task, k), hint_text(task, k, inline)),
                                tool_format=tool_format)


#: The cache key hashes what the warm start trains on first: the training views of its first batches, at least
#: this many demonstrations (all of a shorter warm start's). Drawing them takes about a quarter of a second with
#: the default config (1.4 s with a BPE checkpoint in the hermes format, 2.7 s for bfcl); drawing all of the
#: default warm start's 20,800 would take some twenty seconds.
KEY_DEMONSTRATIONS = 256


def demonstrations_digest(renderer: ChatRenderer, envs: dict[str, Environment], cfg: Config) -> str:
    """A hash of the token ids and loss masks of the warm start's first batches (:func:`demonstration_batches`,
    ``KEY_DEMONSTRATIONS`` demonstrations or more): what the environments demonstrate, so the warm-start cache
    follows a change of their behaviour (a tool's result, an action guide's argument) that leaves their words,
    and so the vocabulary, as they were."""
    ws = cfg.warmstart
    h = hashlib.sha256()
    for batch in itertools.islice(demonstration_batches(renderer, envs, cfg),
                                  min(ws.steps, -(-KEY_DEMONSTRATIONS // ws.batch_size))):
        for tr in batch:
            ids, mask, *_ = tr.training_view()
            h.update(json.dumps([[int(i) for i in ids], mask]).encode())
    return h.hexdigest()


def _cache_key(cfg: Config, base: str, demos: str) -> str:
    """Everything that determines a warm-started model: the config's model and warm-start sections, the
    families, seeds and tool format, ``base`` (the built-in vocabulary, or a checkpoint's fingerprint) and
    ``demos`` (:func:`demonstrations_digest`)."""
    ws = {k: v for k, v in cfg.to_dict()["warmstart"].items() if k != "cache_dir"}
    model = {k: v for k, v in cfg.to_dict()["model"].items()
             if k not in ("cache_dir", "activation_checkpointing") and not k.startswith("lora_")}
    if cfg.model.lora_rank and cfg.model.path:  # the warm start trains adapters (merged into the cached model)
        model.update({k: v for k, v in cfg.to_dict()["model"].items() if k.startswith("lora_")})
    key = {"v": CACHE_VERSION, "model": model, "warmstart": ws, "families": cfg.env.families,
           "env_seed": cfg.env.seed, "seed": cfg.run.seed, "vocab": base, "demonstrations": demos}
    if cfg.env.options:  # (keys without options predate the field)
        key["env_options"] = cfg.env.options
    if cfg.rollout.tool_format != "builtin":  # (the built-in format's keys predate the field)
        key["tool_format"] = cfg.rollout.tool_format
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def warmstart_cache(cfg: Config, envs: dict[str, Environment], tok=None) -> Path:
    """The directory under ``warmstart.cache_dir`` that holds (or will hold) this config's warm-started model.
    ``tok`` is the model's tokenizer (default: the built-in one for ``envs``, or ``model.path``'s), which the
    demonstrations the key hashes are tokenised with. ``rail ablate`` asks it too, to start a seed's other arms
    only once the first has cached it."""
    if cfg.model.path:
        path = model_dir(cfg)
        base = checkpoint_fingerprint(path)
        tok = load_tokenizer(path) if tok is None else tok
    else:
        words = vocabulary(envs)
        base = hashlib.sha256(" ".join(words).encode()).hexdigest()
        tok = build_word_tokenizer(words) if tok is None else tok
    return Path(cfg.warmstart.cache_dir) / _cache_key(cfg, base, demonstrations_digest(ChatRenderer(tok), envs, cfg))


def checkpoint_fingerprint(path: str | Path) -> str:
    """Identifies a model directory's contents: a hash of its small files and of the name, size and
    modification time of its weight files (hashing gigabytes of weights on every start would be slow)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if not f.is_file():
            continue
        st = f.stat()
        h.update(f.name.encode())
        if st.st_size < 16 * 2**20:
            h.update(f.read_bytes())
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def demonstration_batches(renderer: ChatRenderer, envs: dict[str, Environment], cfg: Config, steps: int | None = None):
    """The warm start's batches, in order: ``steps`` (default ``warmstart.steps``; None for ever, with
    :func:`demonstration_stream`) lists of ``warmstart.batch_size`` reference trajectories."""
    return itertools.islice(demonstration_stream(renderer, envs, cfg), cfg.warmstart.steps if steps is None else steps)


def demonstration_stream(renderer: ChatRenderer, envs: dict[str, Environment], cfg: Config):
    """The warm start's batches, without end: lists of ``warmstart.batch_size`` reference trajectories (families
    alternating; a share ``guided_share`` guided, the rest from the imperfect demonstrator), drawn from one
    generator seeded by ``run.seed``; the first ``warmstart.steps`` are :func:`demonstration_batches`."""
    ws, fmt = cfg.warmstart, cfg.rollout.tool_format
    rng = np.random.default_rng([cfg.run.seed, 7919])
    names = sorted(envs)
    alternatives: dict[str, list[str]] = {}  # values each tool's second argument takes in the action guides
    for name in names:
        for task in envs[name].sample_tasks(np.random.default_rng([cfg.run.seed, 7]), envs[name].levels, 200):
            for a in task.action_guide:
                if len(a.args) >= 2:
                    alternatives.setdefault(a.tool, [])
                    if a.args[1] not in alternatives[a.tool]:
                        alternatives[a.tool].append(a.args[1])
    alternatives = {tool: sorted(values) for tool, values in alternatives.items()}  # fixed confusion partners
    while True:
        trajs = []
        for k in range(ws.batch_size):
            env = envs[names[k % len(names)]]
            guided = rng.random() < ws.guided_share
            task = demonstration_task(env, rng, (ws.guided_levels or ws.levels) if guided else ws.levels, guided)
            if guided:
                tr = guided_demonstration(env, task, renderer, rng, fmt)
            else:
                tr = reference_trajectory(env, task, renderer, tool_format=fmt,
                                          actions=demonstration(task, rng, ws.noise, alternatives))
                if not all(st.ok for st in tr.steps):  # a perturbed call left the tool's range: use the guide
                    tr = reference_trajectory(env, task, renderer, tool_format=fmt)
            trajs.append(tr)
        yield trajs


class RehearsalSource:
    """Guided warm-start demonstrations to rehearse during RL (``learner.rehearsal``): the families in turn, each a
    task of ``warmstart.levels`` (``kin``: a nonce name) followed under a plan or a rubric hint, as
    :func:`guided_demonstration` draws them. They keep the policy reading guidance while RL and rationalization
    move it; none is of a level beyond the warm start, so they reveal nothing the warm start did not.
    Deterministic given the seed and the step (:meth:`begin_step`), so a resumed run rehearses the same ones."""

    def __init__(self, renderer: ChatRenderer, envs: dict[str, Environment], cfg: Config):
        self.renderer, self.envs, self.names = renderer, envs, sorted(envs)
        self.seed, self.levels, self.fmt = cfg.run.seed, list(cfg.warmstart.levels), cfg.rollout.tool_format
        self.begin_step(0)

    def begin_step(self, step: int) -> None:
        self.rng = np.random.default_rng([self.seed, step, 5])
        self.k = 0

    def __call__(self, n: int) -> list[Trajectory]:
        out = []
        for _ in range(n):
            env = self.envs[self.names[self.k % len(self.names)]]
            self.k += 1
            task = demonstration_task(env, self.rng, self.levels, True)
            out.append(guided_demonstration(env, task, self.renderer, self.rng, self.fmt))
        return out


def warm_start(model, renderer: ChatRenderer, envs: dict[str, Environment], cfg: Config, progress=None,
               batches=None, steps: int | None = None, first: int = 0) -> list[float]:
    """SFT on reference trajectories of ``warmstart.levels``: ``steps`` (default ``warmstart.steps``) updates on
    ``batches`` (default :func:`demonstration_stream`), AdamW with cosine decay over them; returns the loss curve.
    ``progress(i, loss)`` counts updates from ``first``."""
    ws = cfg.warmstart
    steps = ws.steps if steps is None else steps
    batches = demonstration_stream(renderer, envs, cfg) if batches is None else batches
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ws.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + np.cos(np.pi * min(1.0, i / steps))))
    model.train()
    losses = []
    for i, trajs in enumerate(itertools.islice(batches, steps)):
        opt.zero_grad(set_to_none=True)
        loss = sft_backward(model, trajs, renderer.pad, cfg.learner.logprob_chunk, cfg.learner.tokens_per_pass)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss)
        if progress is not None:
            progress(first + i, losses[-1])
    model.eval()
    return losses


def warm_start_success(model, renderer: ChatRenderer, envs: dict[str, Environment], cfg: Config) -> float:
    """The warm start's check: mean unguided success over families and ``warmstart.levels`` on
    ``warmstart.check_tasks`` held-out tasks each, sampled as evaluation samples (``rail.evaluate``)."""
    import copy

    from policy.engine import TransformersEngine
    from rail.evaluate import evaluate, mean_over
    from rail.rounds import derive_seed

    c = copy.deepcopy(cfg)
    c.eval.levels, c.eval.tasks_per_level = list(cfg.warmstart.levels), cfg.warmstart.check_tasks
    engine = TransformersEngine(model, renderer, batch_size=cfg.rollout.batch_size)
    return mean_over(evaluate(engine, envs, c, seed=derive_seed(cfg.run.seed, 30_000)), c.eval.levels)


def train_warm_start(model, renderer: ChatRenderer, envs: dict[str, Environment], cfg: Config,
                     progress=None) -> tuple[list[float], dict]:
    """The warm start and its check: ``warmstart.steps`` updates, then, while the check's success
    (:func:`warm_start_success`) is below ``warmstart.target``, cycles of ``warmstart.steps // 2`` more (a fresh
    optimizer and cosine schedule each: warm restarts) until it is reached or ``warmstart.max_steps`` would be
    passed. Returns the loss curve and the check: ``{"updates", "success", "target", "met"}`` (``success`` None
    with ``warmstart.target = 0``: no check)."""
    ws = cfg.warmstart
    stream = demonstration_stream(renderer, envs, cfg)
    losses = warm_start(model, renderer, envs, cfg, progress, stream)
    if not ws.target:
        return losses, {"updates": len(losses), "success": None, "target": 0.0, "met": True}
    success = warm_start_success(model, renderer, envs, cfg)
    cycle = max(1, ws.steps // 2)
    while success < ws.target and len(losses) + cycle <= ws.max_steps:
        losses += warm_start(model, renderer, envs, cfg, progress, stream, cycle, first=len(losses))
        success = warm_start_success(model, renderer, envs, cfg)
    return losses, {"updates": len(losses), "success": round(success, 4), "target": ws.target,
                    "met": success >= ws.target}


def _check_message(check: dict, cfg: Config, cache: Path | None) -> str:
    levels = cfg.warmstart.levels
    return (f"warm start: unguided success on levels {levels} reached {check['success']:.3f} after "
            f"{check['updates']} updates, below warmstart.target = {check['target']} (warmstart.max_steps = "
            f"{cfg.warmstart.max_steps}); the policy cannot yet do what the run builds on, so the run stops. "
            f"Try another run.seed, raise warmstart.max_steps, or set warmstart.target lower (0: no check)"
            + (f"; the failed check is recorded in {cache}" if cache is not None else ""))


def model_dir(cfg: Config, progress=None) -> str:
    """The directory ``model.path`` names (:func:`rail.models.model_dir`: a model named by rail converted once)."""
    from rail import models

    say = getattr(progress, "say", None) or (lambda message: print(f"rail: {message}", file=sys.stderr, flush=True))
    return models.model_dir(cfg.model.path, cfg.model.cache_dir, say)


def make_policy(cfg: Config, envs: dict[str, Environment], progress=None):
    """(model, tokenizer, info): the built-in model or the checkpoint at ``model.path``, warm-started (SFT on
    reference trajectories in the model's own chat template and tool-call format, until its check passes:
    :func:`train_warm_start`) unless ``warmstart.enabled`` is false, and cached under ``warmstart.cache_dir``; on
    ``run.device``. A warm start that misses ``warmstart.target`` is a :class:`rail.rundir.RunError` (and is
    remembered in the cache, so another run of the same config stops at once)."""
    from rail.rundir import RunError

    device = resolve_device(cfg.run.device)
    if cfg.model.path:
        path = model_dir(cfg, progress)
        model, tok = load_policy(path)
        if not cfg.warmstart.enabled:
            return with_adapters(model.to(device), cfg, path), tok, {"source": cfg.model.path, "warmstart": "disabled"}
        source = cfg.model.path
    else:
        model, source = None, "built-in"
        tok = build_word_tokenizer(vocabulary(envs))
    cache = warmstart_cache(cfg, envs, tok) if cfg.warmstart.enabled else None
    if cache is not None and (cache / FAILED).is_file():
        check = json.loads((cache / FAILED).read_text())
        raise RunError(_check_message(check, cfg, cache))
    if cache is not None and (cache / "config.json").is_file():
        try:
            model, tok = load_policy(cache)
            check = json.loads((cache / CHECK).read_text()) if (cache / CHECK).is_file() else None
            return (with_adapters(model.to(device), cfg, cache), tok,
                    {"source": source, "warmstart": f"cached ({cache})", "warmstart_check": check})
        except (ValueError, OSError) as e:
            log.warning("warm-start cache %s unreadable (%s); rebuilding it", cache, e)
            if cfg.model.path:
                model, tok = load_policy(path)
    if model is None:
        m = cfg.model
        model = build_tiny_model(len(tok), hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
                                 kv_heads=m.kv_heads, intermediate_size=m.intermediate_size,
                                 max_positions=m.max_positions, seed=cfg.run.seed,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.to(device)  # built or loaded on the CPU (the same weights wherever it trains)
    info = {"source": source, "warmstart": "disabled"}
    if cfg.warmstart.enabled:
        if cfg.model.lora_rank and cfg.model.path:  # a pretrained model warm-starts in adapters too, cached merged
            model = with_adapters(model, cfg, None)
        else:
            checkpointing(model, cfg)
        losses, check = train_warm_start(model, ChatRenderer(tok), envs, cfg, progress)
        if not check["met"]:
            cache.mkdir(parents=True, exist_ok=True)
            write_text_atomic(cache / FAILED, json.dumps(check))
            raise RunError(_check_message(check, cfg, cache))
        model = merged(model)
        save_policy(model, tok, cache)
        write_text_atomic(cache / CHECK, json.dumps(check))
        info = {"source": source, "warmstart": f"trained ({cache})", "warmstart_final_loss": losses[-1],
                "warmstart_check": check}
    return with_adapters(model, cfg, cache), tok, info


def with_adapters(model, cfg: Config, base: str | Path | None):
    """``model`` with fresh LoRA adapters when ``model.lora_rank`` > 0 (:mod:`policy.lora`), else itself; with
    activation checkpointing when ``model.activation_checkpointing``. ``base``: the directory holding
    ``model``'s weights, which a checkpoint of the adapters names (None: the adapters are merged before anything
    is saved, as the warm start's are)."""
    checkpointing(model, cfg)
    if not cfg.model.lora_rank:
        return model
    from policy.lora import apply_lora

    m = cfg.model
    return apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_targets, base)


def checkpointing(model, cfg: Config):
    """Turn on activation checkpointing for training when ``model.activation_checkpointing`` (a no-op
    otherwise, and in eval mode: the engines generate with the model in eval mode, so their KV caches stay)."""
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


#: in a warm-start cache directory: the check of the warm start it holds, or of one that missed its target
CHECK, FAILED = "check.json", "failed.json"
