# Is the testbed's boundary a valid one? The interventions are claimed to help beyond the warm start's boundary:
# at levels the unguided policy almost never solves, but whose skill is learnable and where the help a task carries
# reveals what is missing. For every such cell (family x level: env.levels not in warmstart.levels) this probe
# measures the three figures that claim rests on, on the held-out tasks of the cell:
#   capacity  unguided success after supervised training of a copy of the warm start on the cell's reference
#             trajectories, for as many optimizer updates as a default `rail train` run makes (target >= 0.6);
#   unguided  the warm start's own unguided success (target < 0.05);
#   rescue    the best single intervention operator's success from the groups with no success (target >= 0.3).
# It writes docs/claim/boundary.json and docs/claim/boundary.md and prints the table.
# Run: .venv/bin/python experiments/probe_boundary.py --threads 1 [--tasks 48] [--families calc --levels 3]
"""The boundary probe: capacity, unguided success and rescue for every cell beyond the warm start."""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from _probe import add_common_args, operator_keys, operator_rollouts, probe_config, rollout_groups, setup
from policy.engine import SamplingParams, TransformersEngine
from policy.fileio import write_text_atomic
from policy.records import succeeded
from rail.config import Config, ConfigError
from rail.envs import ToolRunner, make_env
from rail.policy_setup import warm_start
from rail.rounds import derive_seed

ROOT = Path(__file__).resolve().parents[1]
#: capacity and rescue pass at or above their target, unguided below its own
TARGETS = {"capacity": 0.6, "unguided": 0.05, "rescue": 0.3}
FIGURES = ("capacity", "unguided", "rescue")


# ---------------------------------------------------------------------------------------------- what is measured
def default_sft_updates(cfg: Config) -> tuple[int, str]:
    """The optimizer updates of a ``rail train`` run of ``cfg``, and how they follow from it: every training step
    runs ``learner.epochs`` passes of minibatches of ``learner.minibatch_size`` trajectories over the step's
    rollouts (``budget.rollouts_per_step``; ``GRPOLearner.update``), so a run whose every rollout is trained makes
    ``run.steps x epochs x ceil(rollouts_per_step / minibatch_size)`` updates. The filters (zero-variance
    groups) leave fewer in practice, so it is what a run makes at most, guided replays aside."""
    per_step = cfg.learner.epochs * math.ceil(cfg.budget.rollouts_per_step / cfg.learner.minibatch_size)
    how = (f"run.steps {cfg.run.steps} x learner.epochs {cfg.learner.epochs} x ceil(budget.rollouts_per_step "
           f"{cfg.budget.rollouts_per_step} / learner.minibatch_size {cfg.learner.minibatch_size})")
    return cfg.run.steps * per_step, how


def beyond_levels(cfg: Config) -> list[int]:
    """The levels training draws from that the warm start does not demonstrate."""
    return [lv for lv in cfg.env.levels if lv not in cfg.warmstart.levels]


def eval_params(cfg: Config) -> SamplingParams:
    """How held-out tasks are sampled, as ``rail eval`` samples them (``eval.temperature``, no nucleus cut)."""
    return SamplingParams(cfg.eval.temperature, 1.0, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_turns)


def cell_sft_config(cfg: Config, level: int, updates: int) -> Config:
    """The warm start's settings (batch size, learning rate and schedule, seed) for supervised training on one
    level: ``updates`` steps of clean reference trajectories of ``level`` (no imperfect demonstrator, no guided
    demonstrations)."""
    c = copy.deepcopy(cfg)
    c.warmstart.levels, c.warmstart.steps = [level], updates
    c.warmstart.noise, c.warmstart.guided_share = 0.0, 0.0
    return c


def sft_on_cell(model, renderer, family: str, env, cfg: Config, level: int, updates: int, progress=None):
    """``(trained copy of model, loss curve)``: the warm start's own supervised training
    (:func:`rail.policy_setup.warm_start`: its demonstration batches, loss and optimizer) of a copy of ``model`` on
    ``family``'s training tasks of ``level`` (:func:`cell_sft_config`). ``model`` itself is left as it was."""
    twin = copy.deepcopy(model)
    losses = warm_start(twin, renderer, {family: env}, cell_sft_config(cfg, level, updates), progress)
    return twin, losses


def success(trajs) -> float:
    """The share of ``trajs`` whose verifier reward is 1 (solved)."""
    return float(np.mean([succeeded(tr.reward) for tr in trajs])) if trajs else float("nan")


def rescue_rates(engine, params: SamplingParams, env, runner, tasks: list, groups: list[list], how_many: int,
                 max_tokens_per_turn: int, seed: int) -> tuple[dict, int]:
    """``({how@where: {"success", "rollouts", "groups", "rescued_groups"}}, failed groups)``: each operator's
    ``how_many`` rollouts from every group with no success that it can act on, all operators with the same
    sampling seed; operators that can act on none of them are left out."""
    failed = [i for i, g in enumerate(groups) if not any(succeeded(tr.reward) for tr in g)]
    out = {}
    for key in operator_keys():
        rq, trajs, rewards = operator_rollouts(engine, params, env, runner, tasks, groups, key, how_many,
                                               max_tokens_per_turn, seed, only=failed)
        if not rq:
            continue
        won = {r.group for r, rw in zip(rq, rewards) if succeeded(rw)}
        out[key] = {"success": float(np.mean([succeeded(rw) for rw in rewards])), "rollouts": len(rq),
                    "groups": len({r.group for r in rq}), "rescued_groups": len(won)}
    return out, len(failed)


def cell_record(capacity: float, unguided: float, operators: dict, tasks: int, **extra) -> dict:
    """One cell of the report: the three figures, the best operator (the first of :func:`operator_keys` order
    among equals; none without a failed group to act on) and whether each figure meets its target."""
    best = max(operators, key=lambda k: operators[k]["success"]) if operators else None
    rescue = operators[best]["success"] if best is not None else None
    passes = {"capacity": capacity >= TARGETS["capacity"], "unguided": unguided < TARGETS["unguided"],
              "rescue": rescue is not None and rescue >= TARGETS["rescue"]}
    ops = {k: {**v, "success": round(v["success"], 4)} for k, v in operators.items()}
    return {"capacity": round(capacity, 4), "unguided": round(unguided, 4),
            "rescue": None if rescue is None else round(rescue, 4), "rescue_operator": best, "operators": ops,
            "tasks": tasks, "passes": passes, **extra}


# ---------------------------------------------------------------------------------------------- the report
def build_report(cells: dict, config: dict, command: str, seconds: float) -> dict:
    return {"cells": cells, "targets": dict(TARGETS), "config": config, "command": command,
            "seconds": round(seconds, 1)}


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _mark(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def table_rows(report: dict) -> list[list[str]]:
    rows = [["cell", "capacity", "unguided", "rescue", "best operator", "tasks", "failed groups"]]
    for name, c in report["cells"].items():
        p = c["passes"]
        rows.append([name, f"{_fmt(c['capacity'])} {_mark(p['capacity'])}",
                     f"{_fmt(c['unguided'])} {_mark(p['unguided'])}", f"{_fmt(c['rescue'])} {_mark(p['rescue'])}",
                     c["rescue_operator"] or "-", str(c["tasks"]), str(c.get("failed_groups", "-"))])
    return rows


def text_table(report: dict) -> str:
    rows = table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def verdict(report: dict) -> str:
    """Which cells meet all three targets, and which figure each other cell misses."""
    cells = report["cells"]
    ok = [name for name, c in cells.items() if all(c["passes"].values())]
    missed = [f"{name} ({', '.join(f for f in FIGURES if not c['passes'][f])})" for name, c in cells.items()
              if name not in ok]
    return (f"All three targets met: {len(ok)} of {len(cells)} cells ({', '.join(ok) or 'none'})."
            + (f" Missed: {'; '.join(missed)}." if missed else ""))


def markdown(report: dict) -> str:
    t, cfg = report["targets"], report["config"]
    rows = table_rows(report)
    if cfg["sft_updates"] == cfg["sft_updates_default"]:
        updates = f", as many as a default `rail train` run makes ({cfg['sft_updates_from']})"
    else:
        updates = (f" (set by --sft-updates; a default `rail train` run makes {cfg['sft_updates_default']}: "
                   f"{cfg['sft_updates_from']})")
    lines = [
        "# The boundary probe: is the testbed's boundary a valid one?",
        "",
        "The interventions are claimed to help *beyond the warm start's boundary*: at levels the unguided policy "
        "almost never solves, but whose skill is learnable, and where the help a task carries reveals what is "
        "missing. `experiments/probe_boundary.py` measures the three figures that claim rests on for every cell "
        f"(family x level) beyond the warm start (levels {cfg['levels']}, warm-start levels "
        f"{cfg['warmstart_levels']}), on the cell's held-out tasks ({cfg['tasks']} per cell, "
        f"{cfg['rollouts']} rollouts each). Success is the share of rollouts whose verifier reward is 1.",
        "",
        f"**capacity** (target >= {t['capacity']}): unguided success on the cell's held-out tasks after supervised "
        "training of a copy of the warm-started model on reference trajectories (the action guide, executed in the "
        f"environment) of the cell's training tasks, for {cfg['sft_updates']} optimizer updates{updates}. The "
        "training is the warm start's own "
        f"(`rail.policy_setup.warm_start`: batches of {cfg['sft_batch_size']} demonstrations, AdamW at "
        f"{cfg['sft_lr']} with cosine decay) without its imperfect demonstrator or guided demonstrations. It says "
        "whether the skill fits the model: the figure RL with interventions could reach at most, given perfect "
        "demonstrations in place of rewards.",
        "",
        f"**unguided** (target < {t['unguided']}): the warm-started policy's own unguided success on the same "
        f"held-out tasks (sampled as `rail eval` samples, temperature {cfg['eval_temperature']}). Below the target "
        "a group of rollouts almost never holds a success, so plain GRPO gets no signal there: the cell lies "
        "beyond the boundary.",
        "",
        f"**rescue** (target >= {t['rescue']}): for each held-out task whose {cfg['rollouts']} unguided rollouts "
        "(sampled as training samples, temperature "
        f"{cfg['rollout_temperature']}) all failed, each single intervention operator (every legal `how@where` of "
        f"`rail.interventions`) branches {cfg['rollouts']} rollouts from the group's failed trajectory with the "
        "most rubric progress; an operator's figure is the share of its rollouts that succeed, over all failed "
        "groups it can act on. *rescue* is the best operator's figure: whether the help a task carries reveals "
        "what is missing, so a rescued rollout can carry a learning signal.",
        "",
        "Command:",
        "",
        f"    {report['command']}",
        "",
        f"Seed {cfg['seed']}; {report['seconds']:.0f} s on {cfg['threads'] or 'default'} torch thread(s); "
        f"warm start: {cfg['warmstart']}.",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
        *["| " + " | ".join(r) + " |" for r in rows[1:]],
        "",
        verdict(report),
        "",
        "Every operator's success from the failed groups (rollouts in brackets):",
        "",
    ]
    keys = [k for k in operator_keys() if any(k in c["operators"] for c in report["cells"].values())]
    lines += ["| cell | " + " | ".join(f"`{k}`" for k in keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, c in report["cells"].items():
        ops = c["operators"]
        lines.append(f"| {name} | " + " | ".join(
            f"{ops[k]['success']:.3f} ({ops[k]['rollouts']})" if k in ops else "-" for k in keys) + " |")
    lines.append("")
    return "\n".join(lines)


def write_report(out: Path, report: dict) -> tuple[Path, Path]:
    """``out/boundary.json`` and ``out/boundary.md``, each written atomically."""
    out = Path(out)
    paths = out / "boundary.json", out / "boundary.md"
    write_text_atomic(paths[0], json.dumps(report, indent=1) + "\n")
    write_text_atomic(paths[1], markdown(report))
    return paths


# ---------------------------------------------------------------------------------------------- the command
def command_line(argv: list[str]) -> str:
    script = Path(argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join([".venv/bin/python", str(script), *argv[1:]])


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("docs/claim"), help="where boundary.json and .md go")
    ap.add_argument("--tasks", type=int, default=0, help="held-out tasks per cell (0: eval.tasks_per_level)")
    ap.add_argument("--rollouts", type=int, default=0,
                    help="rollouts per task, and per operator from each failed group (0: budget.group_size)")
    ap.add_argument("--seed", type=int, default=None, help="run.seed (another seed trains its own warm start)")
    ap.add_argument("--families", nargs="+", default=None, help="families to probe (default: env.families)")
    ap.add_argument("--levels", type=int, nargs="+", default=None,
                    help="levels to probe (default: env.levels not in warmstart.levels)")
    ap.add_argument("--sft-updates", type=int, default=0,
                    help="supervised updates for capacity (0: as many as a default rail train run makes)")
    add_common_args(ap)
    a = ap.parse_args(argv)
    for flag, v, low in (("--tasks", a.tasks, 0), ("--rollouts", a.rollouts, 0), ("--sft-updates", a.sft_updates, 0),
                         ("--threads", a.threads, 0)):
        if v < low:
            ap.error(f"{flag} {v}: must be >= {low}")
    if a.out.exists() and not a.out.is_dir():
        ap.error(f"--out {a.out}: is a file; name a directory")
    try:
        cfg = probe_config(a, [{"run": {"seed": a.seed}}] if a.seed is not None else [])
    except ConfigError as e:
        ap.error(str(e))
    a.tasks = a.tasks or cfg.eval.tasks_per_level
    a.rollouts = a.rollouts or cfg.budget.group_size
    families = a.families or list(cfg.env.families)
    for fam in families:
        if fam not in cfg.env.families:
            ap.error(f"--families: {fam!r} is not in env.families {cfg.env.families} (the warm start is trained on "
                     f"those; change them with --set 'env.families=[...]')")
    if len(set(families)) != len(families):
        ap.error(f"--families {families}: a family appears twice")
    levels = a.levels or beyond_levels(cfg)
    if not levels:
        ap.error(f"env.levels {cfg.env.levels} holds no level beyond warmstart.levels {cfg.warmstart.levels}; "
                 "name the levels with --levels")
    if len(set(levels)) != len(levels):
        ap.error(f"--levels {levels}: a level appears twice")
    for fam in families:
        env = make_env(fam, cfg.env.seed, cfg.env.options.get(fam))
        for lv in levels:
            try:
                env.eval_tasks(lv, a.tasks)
            except ValueError as e:
                ap.error(f"--levels / --tasks: {e}")
    return a, cfg, families, levels


def main(argv: list[str] | None = None) -> dict:
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    argv = sys.argv if argv is None else argv
    a, cfg, families, levels = parse_args(argv[1:])
    cfg, envs, model, renderer, engine, params, info = setup(a, cfg)
    rollouts = a.rollouts
    default_updates, updates_from = default_sft_updates(cfg)
    updates = a.sft_updates or default_updates
    print(f"supervised updates per cell: {updates} ({'--sft-updates; ' if a.sft_updates else ''}a default run makes "
          f"{default_updates}: {updates_from}); warm start {info.get('warmstart')}", flush=True)
    ev = eval_params(cfg)
    cells = {}
    bar = tqdm(total=len(families) * len(levels), desc="cells", unit="cell", dynamic_ncols=True)
    for fam in families:
        env, runner = envs[fam], ToolRunner(envs[fam], cfg.rollout.tool_format)
        k = cfg.env.families.index(fam)  # the seeds follow the cell, whichever others run beside it
        for lv in levels:
            name = f"{fam} L{lv}"
            seed = lambda kind: derive_seed(cfg.run.seed, 30_000, k, lv, kind)  # noqa: E731
            tasks = env.eval_tasks(lv, a.tasks)
            bar.set_description(f"{name}: unguided")
            groups = rollout_groups(engine, ev, env, runner, tasks, rollouts, seed(0))
            unguided = success([tr for g in groups for tr in g])
            if ev != params:  # the groups an intervention acts on are sampled as training samples them
                groups = rollout_groups(engine, params, env, runner, tasks, rollouts, seed(1))
            bar.set_description(f"{name}: rescue")
            ops, failed = rescue_rates(engine, params, env, runner, tasks, groups, rollouts,
                                       cfg.rollout.max_tokens_per_turn, seed(2))
            bar.set_description(f"{name}: supervised")
            sft_bar = tqdm(total=updates, desc=f"{name} sft", unit="update", leave=False, dynamic_ncols=True)

            def progress(i, loss, sft_bar=sft_bar):
                sft_bar.update(1)
                sft_bar.set_postfix(loss=f"{loss:.3f}")

            twin, losses = sft_on_cell(model, renderer, fam, env, cfg, lv, updates, progress)
            sft_bar.close()
            bar.set_description(f"{name}: capacity")
            twin_engine = TransformersEngine(twin, renderer, batch_size=cfg.rollout.batch_size)
            capacity = success([tr for g in rollout_groups(twin_engine, ev, env, runner, tasks, rollouts, seed(0))
                                for tr in g])
            del twin, twin_engine
            cells[name] = cell_record(capacity, unguided, ops, len(tasks), failed_groups=failed,
                                      sft_loss_first=round(losses[0], 4), sft_loss_last=round(losses[-1], 4))
            bar.update(1)
            bar.set_postfix(capacity=f"{capacity:.2f}", unguided=f"{unguided:.2f}",
                            rescue=_fmt(cells[name]["rescue"]))
    bar.close()
    config = {"seed": cfg.run.seed, "env_seed": cfg.env.seed, "families": families, "levels": levels,
              "warmstart_levels": list(cfg.warmstart.levels), "sft_updates": updates,
              "sft_updates_default": default_updates, "sft_updates_from": updates_from,
              "sft_batch_size": cfg.warmstart.batch_size, "sft_lr": cfg.warmstart.lr, "tasks": a.tasks,
              "rollouts": rollouts, "eval_temperature": cfg.eval.temperature,
              "rollout_temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p, "sets": list(a.sets),
              "threads": a.threads, "warmstart": info.get("warmstart")}
    report = build_report(cells, config, command_line(argv), time.perf_counter() - t0)
    json_path, md_path = write_report(a.out, report)
    print(text_table(report))
    print(f"wrote {json_path} and {md_path} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
