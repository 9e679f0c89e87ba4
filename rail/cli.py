"""``rail``: the command line. Arguments and config are parsed before torch is imported, so ``--help`` and
config errors are instant, and every path and name on the command line is checked before an output directory
is made: a bad one exits with status 2 and one ``rail: ...`` line naming the argument and the fix (``rail
ablate`` checks every arm's config before it starts anything).

One grammar: a command that acts on an existing run takes it as the positional ``RUN`` (``rail resume RUN``,
``rail eval RUN``, ``rail traces evaluate|show RUN``), ``rail report`` its ablation directory as ``ABLATION``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

from rail.config import PRESETS, Config, ConfigError, build_config, config_toml, load_toml, parse_set
from rail.controllers import CONTROLLERS

#: the controller that learns, and the only one that writes a decision trace (traces/decisions.dsjson)
LEARNED = "rail"
_DEFAULTS = Config()


class UsageError(Exception):
    """A command line that cannot work (a path that is not there, a value out of range): exit status 2 and one
    line naming the argument and the fix."""


class _Formatter(argparse.HelpFormatter):
    """Help that keeps the descriptions' paragraphs (wrapped one by one) and shows each option's default where
    it has one."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=32)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(super(_Formatter, self)._fill_text(par, width, indent) for par in text.split("\n\n"))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "(default" in text or action.default is argparse.SUPPRESS
                or action.default in (None, False, [])):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one ``rail: ...`` line and exit status 2 (:class:`UsageError`), also
    when :func:`main` is called in-process."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)

    def error(self, message: str):
        raise UsageError(f"{message}; see `{self.prog} --help`")


def _default(key: str) -> str:
    """``section.name``'s default, as help shows it."""
    section, name = key.split(".")
    v = getattr(getattr(_DEFAULTS, section), name)
    return (repr(v) if isinstance(v, str) else str(v)).replace("%", "%%")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rail")
    except PackageNotFoundError:
        import rail
        return getattr(rail, "__version__", "unknown")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return n


def parse_seeds(text: str) -> list[int]:
    """``rail ablate --seeds``: a count (``5``: seeds 0..4) or a list of seeds (``0,3,7`` or ``[0,3,7]``)."""
    t = text.strip()
    how = "a count (5: seeds 0..4) or a list of seeds (0,3,7 or [0,3,7])"
    if t.isdigit():
        if int(t) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a count of seeds must be >= 1; give {how}")
        return list(range(int(t)))
    body = t[1:-1] if t.startswith("[") and t.endswith("]") else t
    try:
        seeds = [int(s) for s in body.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not {how}") from None
    if any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: seeds must be >= 0")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: a seed appears twice")
    return seeds


# ---------------------------------------------------------------------------- the parsers
def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="post-train a policy with GRPO under a rollout budget, in a new run directory",
        description="Post-train a policy with GRPO under a rollout budget, in a new run directory (--out).\n\n"
                    "Config precedence: defaults < --preset < --config TOML < the flags below < --set. "
                    "Every field: docs/configuration.md. `rail train --print-config` shows the result.")
    p.add_argument("--preset", default="default", choices=list(PRESETS),
                   help="named preset: default (the CPU demonstration), smoke (a few steps: seconds)")
    p.add_argument("--config", metavar="FILE", help="TOML file with [section] tables of config keys")
    p.add_argument("--steps", type=int, metavar="N", help=f"run.steps (default: {_default('run.steps')})")
    p.add_argument("--budget", type=int, metavar="N",
                   help=f"budget.rollouts_per_step, or budget.tokens_per_step with budget.unit = 'tokens' "
                        f"(default: {_default('budget.rollouts_per_step')} rollouts)")
    p.add_argument("--group-size", type=int, metavar="N",
                   help=f"budget.group_size (default: {_default('budget.group_size')})")
    p.add_argument("--controller", choices=list(CONTROLLERS),
                   help=f"controller.name: '{LEARNED}' is the learned contextual bandit, the others fixed "
                        f"controllers (default: {_default('controller.name')})")
    p.add_argument("--controller-from", metavar="RUN",
                   help="controller.init_from: start the learned controller from an earlier run's decision trace")
    p.add_argument("--seed", type=int, metavar="N", help=f"run.seed (default: {_default('run.seed')})")
    p.add_argument("--model", metavar="PATH",
                   help="model.path: a Hugging Face model directory, or a model rail knows by name "
                        "(smollm2-135m) (default: the built-in tiny Qwen2)")
    p.add_argument("--out", metavar="DIR", help="run.out, the run directory (default: runs/<run.name>)")
    p.add_argument("--tracking-uri", metavar="URI",
                   help=f"tracking.uri; '' turns MLflow off (default: $MLFLOW_TRACKING_URI when set, else "
                        f"{_default('tracking.uri')})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config field, e.g. learner.lr=5e-4 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--print-config", action="store_true",
                      help="print the resolved config as TOML (every field; --config reads it back) and exit")
    what.add_argument("--dry-run", action="store_true",
                      help="check the config, the model, the environments and every path, print what the run "
                           "would be, and exit without writing anything")
    p.add_argument("--resume", metavar="DIR", help=argparse.SUPPRESS)  # the old spelling of `rail resume DIR`


def _resume_parser(sub) -> None:
    p = sub.add_parser(
        "resume", help="continue a run from its last checkpoint",
        description="Continue the run in RUN from its newest usable checkpoint, with the config it was started "
                    "with. A run stopped before its first checkpoint starts again from the beginning.")
    p.add_argument("run", metavar="RUN", help="the run directory (the --out of `rail train`)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--dry-run", action="store_true",
                   help="check RUN and its config, print where it would continue, and exit without writing anything")


def _eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a checkpoint on the held-out tasks",
        description="Evaluate a checkpoint on the held-out tasks: unguided success per family and level.")
    p.add_argument("run", metavar="RUN", nargs="?",
                   help="a run directory (its newest usable checkpoint) or one of its checkpoint directories")
    p.add_argument("--checkpoint", metavar="DIR", help=argparse.SUPPRESS)  # the old spelling of RUN
    p.add_argument("--tasks-per-level", type=int, metavar="N",
                   help=f"eval.tasks_per_level (default: the run's, {_default('eval.tasks_per_level')} unless set)")
    p.add_argument("--temperature", type=float, metavar="T", help="eval.temperature, 0: greedy (default: the run's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")


def _traces_parser(sub) -> None:
    p = sub.add_parser(
        "traces", help="read the learned controller's decision trace",
        description=f"Read the decision trace of the learned controller ('{LEARNED}'): RUN/traces/decisions.dsjson, "
                    "one line per decision and its outcome. Other controllers write no trace.")
    tsub = p.add_subparsers(dest="traces_command", metavar="COMMAND", required=True)
    run_help = "a run directory of the learned controller, or its decisions.dsjson"
    e = tsub.add_parser(
        "evaluate", help="off-policy estimates (IPS, SNIPS, DR) of policies over a trace",
        description="Off-policy estimates (IPS, SNIPS, doubly robust, with intervals) of the controller reward over "
                    "RUN's trace, for the logged policy, the learned bandit (replayed), the heuristic it shadowed, "
                    "none, uniform and each --policy.")
    e.add_argument("run", metavar="RUN", help=run_help)
    e.add_argument("--policy", action="append", default=[], metavar="HOW@WHERE",
                   help="also evaluate the fixed rule 'this intervention when legal' (repeatable)")
    e.add_argument("--alpha", type=float, default=0.05, help="1 - the confidence level of the intervals")
    e.add_argument("--json", action="store_true", help="print the result as JSON only")
    s = tsub.add_parser(
        "show", help="the controller's decisions in plain words, one per line",
        description="The learned controller's decisions in RUN's trace, in the order it learned them, one per line: "
                    "step, family/level, group (and round), what it chose with its propensity and mode, the "
                    "heuristic's choice where it differs, how the intervention's rollouts did, and the reward.")
    s.add_argument("run", metavar="RUN", help=run_help)
    s.add_argument("--limit", type=_positive, metavar="N", help="show the first N decisions (default: all)")
    s.add_argument("--step", type=int, metavar="S", help="only the decisions of training step S")


def _ablate_parser(sub) -> None:
    p = sub.add_parser(
        "ablate", help="run a controller ablation: every arm x seed under one budget, tracked in MLflow",
        description="Runs every (arm, seed) of an ablation file (docs/ablation.md) as `rail train` worker "
                    "processes or Ray tasks; rerunning skips finished pairs and resumes killed ones.")
    p.add_argument("--config", required=True, metavar="FILE",
                   help="ablation TOML file, e.g. experiments/ablations/controllers.toml")
    p.add_argument("--seeds", type=parse_seeds, metavar="SEEDS",
                   help="a count (5: seeds 0..4) or a list of seeds (0,3,7 or [0,3,7]) (default: the file's)")
    p.add_argument("--workers", type=_positive, metavar="N",
                   help="parallel training processes (default: one per core, at most the jobs); each gets "
                        "cores // workers torch threads. With --backend ray: at most this many jobs submitted at "
                        "once (default: all)")
    p.add_argument("--backend", choices=("process", "ray"), default="process",
                   help="where jobs run: worker processes here, or Ray tasks (needs the ray extra)")
    p.add_argument("--address", metavar="HOST:PORT",
                   help="--backend ray: join this Ray cluster (HOST:PORT, or auto) instead of starting a local "
                        "Ray instance")
    p.add_argument("--num-cpus", type=float, metavar="N",
                   help="--backend ray: CPUs per job (resources.num_cpus; default: 1); the job trains with that "
                        "many threads")
    p.add_argument("--num-gpus", type=float, metavar="N",
                   help="--backend ray: GPUs per job (resources.num_gpus; default: 0)")
    p.add_argument("--preset", default="default", choices=list(PRESETS),
                   help="training preset of every arm: default, smoke (seconds per run)")
    p.add_argument("--out", metavar="DIR",
                   help="output directory (default: runs/ablate-<name>); runs go in <out>/<arm>/seed<k>/")
    p.add_argument("--tracking-uri", metavar="URI", help="tracking.uri of every run ('' turns MLflow off)")
    p.add_argument("--arms", metavar="A,B,...", help="comma-separated subset of the file's arms (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config field for every arm (before the arms' own settings; repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the jobs and what would be done, run nothing")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")


def _report_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="the report of an ablation: report.md, report.json and figures",
        description="The report of an ablation (docs/ablation.md): report.md, report.json and PNG figures, "
                    "written into the ablation directory (or --out) and logged to its MLflow parent run.")
    p.add_argument("target", metavar="ABLATION",
                   help="an ablation directory (the --out of `rail ablate`), or with --tracking-uri its MLflow "
                        "parent run id or experiment")
    p.add_argument("--out", metavar="DIR", help="write the report here (default: the ablation directory)")
    p.add_argument("--tracking-uri", metavar="URI", help="MLflow tracking URI to look up a run id or experiment")
    p.add_argument("--json", action="store_true", help="print report.json instead of the verdict")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rail",
        description="RAIL: GRPO post-training of LLM agents, with a learned controller that decides where, how and "
                    "how many rollouts to intervene on under a fixed rollout budget.",
        epilog="`rail COMMAND --help` shows a command's options; the manual is docs/usage.md.")
    parser.add_argument("--version", action="version", version=f"rail {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for add in (_train_parser, _resume_parser, _eval_parser, _traces_parser, _ablate_parser, _report_parser):
        add(sub)
    return parser


# ---------------------------------------------------------------------------- checks of what the line names
def _controller_of(run: Path) -> str | None:
    """The controller a run directory was started with (its config.json, else its summary.json); None when
    neither says."""
    for name, get in (("config.json", lambda d: d["controller"]["name"]), ("summary.json", lambda d: d["controller"])):
        try:
            v = get(json.loads((run / name).read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(v, str):
            return v
    return None


def trace_of(path: str, arg: str = "RUN") -> Path:
    """The decision trace ``arg`` names: a trace file, or a run (or traces) directory's; a :class:`UsageError`
    saying why there is none (no such path, a controller that writes none, none yet)."""
    from controller.traces import find_trace

    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise UsageError(f"{arg} {path}: no such file or directory; name a run directory of the learned controller "
                         "or its traces/decisions.dsjson")
    ctl = _controller_of(p)
    if ctl is not None and ctl != LEARNED:
        if arg == "RUN":
            raise UsageError(f"controller {ctl!r} writes no trace (only the learned controller does); {path}")
        raise UsageError(f"{arg} {path}: controller {ctl!r} writes no trace (only the learned controller does); "
                         f"name a run of controller '{LEARNED}'")
    trace = find_trace(p)
    if trace is None:
        raise UsageError(f"{arg} {path}: no decision trace there (traces/decisions.dsjson); name a run directory "
                         f"of the learned controller ('{LEARNED}') that has made a decision")
    return trace


def run_dir(path: str, arg: str = "RUN") -> Path:
    """A run directory ``arg`` names (it holds config.json), or a :class:`UsageError` saying what to name."""
    p = Path(path)
    if not p.is_dir():
        why = "not a directory" if p.exists() else "no such directory"
        raise UsageError(f"{arg} {path}: {why}; name a run directory (the --out of `rail train`, runs/<name> by "
                         "default)")
    if not (p / "config.json").is_file():
        raise UsageError(f"{arg} {path}: not a rail run directory (no config.json); name the --out of a "
                         "`rail train`")
    return p


def checkpoint_target(path: str, arg: str = "RUN") -> Path:
    """What ``rail eval`` evaluates: a run directory with a checkpoint, or a checkpoint directory."""
    from rail.rundir import has_checkpoint

    p = Path(path)
    if (p / "manifest.json").is_file() or (p / "model").is_dir():
        return p
    run = run_dir(path, arg)
    if not has_checkpoint(run):
        raise UsageError(f"{arg} {path}: no checkpoint yet (the run stopped before its first one); continue it "
                         f"with `rail resume {path}`")
    return run


def _old_spelling(old: str, new: str) -> None:
    print(f"rail: warning: `{old}` is spelled `{new}` now", file=sys.stderr)


# ---------------------------------------------------------------------------- train and resume
def config_from_args(a: argparse.Namespace):
    sets: list[dict] = []
    flag = {"steps": "run.steps", "group_size": "budget.group_size", "controller": "controller.name",
            "seed": "run.seed", "model": "model.path", "out": "run.out", "tracking_uri": "tracking.uri",
            "controller_from": "controller.init_from"}
    for attr, key in flag.items():
        v = getattr(a, attr)
        if v is not None:
            section, name = key.split(".")
            sets.append({section: {name: v}})
    toml = load_toml(a.config) if a.config else None
    user_sets = [parse_set(s) for s in a.set]
    unit = None
    for d in [toml or {}, *user_sets]:
        unit = d.get("budget", {}).get("unit", unit)
    if a.budget is not None:
        sets.append({"budget": {"tokens_per_step" if unit == "tokens" else "rollouts_per_step": a.budget}})
    sets.extend(user_sets)
    return build_config(a.preset, toml, sets)


def _out_of(cfg) -> Path:
    return Path(cfg.run.out or os.path.join("runs", cfg.run.name))


def _check_envs(cfg) -> None:
    """What a run checks of its environments before it trains (rail/train.py ``Trainer``): each builds, and has a
    task at env.levels (and at the shifted mix's levels); nothing is written."""
    import numpy as np

    from rail.envs import make_envs
    from rail.rundir import RunError

    try:
        envs = make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)
        for env in envs.values():
            env.sample_tasks(np.random.default_rng(0), cfg.env.levels, 1)
        if cfg.env.shift_step:
            for fam in cfg.env.shift_families or cfg.env.families:
                envs[fam].sample_tasks(np.random.default_rng(0), cfg.env.shift_levels or cfg.env.levels, 1)
    except ValueError as e:
        raise RunError(f"env.families / env.options / env.levels: {e}") from None


def _describe(cfg, out: Path, status: str) -> list[str]:
    """The short summary a dry run prints."""
    m, b, c = cfg.model, cfg.budget, cfg.controller
    if not m.path:
        model = f"built-in tiny Qwen2 (hidden {m.hidden_size}, {m.layers} layers)"
    else:
        model = m.path + (f", LoRA rank {m.lora_rank}" if getattr(m, "lora_rank", 0) else "")
    model += f"; warm start {cfg.warmstart.steps} steps" if cfg.warmstart.enabled else "; no warm start"
    levels = ", ".join(map(str, cfg.env.levels))
    unit = "rollouts" if b.unit == "rollouts" else "tokens"
    total = f", {b.total} {unit} in all" if b.total else ""
    ctl = c.name + (" (learned)" if c.name == LEARNED else " (fixed)")
    if c.init_from:
        ctl += f", starting from {c.init_from}"
    tracking = cfg.tracking.uri or "off"
    return [f"run dir:     {out} ({status})",
            f"model:       {model}",
            f"envs:        {', '.join(cfg.env.families)} at levels {levels}",
            f"budget:      {cfg.step_budget()} {unit} per step, groups of {b.group_size}{total}",
            f"controller:  {ctl}",
            f"steps:       {cfg.run.steps} (checkpoint every {cfg.run.checkpoint_every}, evaluate every {cfg.eval.every})",
            f"tracking:    {tracking}"]


def _dry_run_train(cfg) -> int:
    from rail.rundir import RunError, has_checkpoint, is_run_config

    out = _out_of(cfg)
    if out.exists() and not out.is_dir():
        raise RunError(f"run.out {out}: is a file, not a directory; choose another --out")
    if not out.exists():
        status = "would be created"
    elif not (out / "config.json").exists():
        status = "exists, holds no run"
    elif (out / "summary.json").exists() or has_checkpoint(out):
        raise RunError(f"{out} already holds a run; continue it with `rail resume {out}` or choose another --out")
    elif not is_run_config(out / "config.json"):
        raise RunError(f"{out}: holds a config.json that is not a rail run's; choose another --out")
    else:
        status = "holds a run stopped before its first checkpoint: it would be replaced"
    _check_envs(cfg)
    print("\n".join(_describe(cfg, out, status)))
    print("dry run: everything checked, nothing written")
    return 0


def _run_trainer(trainer, out: Path) -> int:
    try:
        summary = trainer.run()
    except OSError as e:  # a full disk, a directory gone: checkpoints are written atomically, so the last one holds
        from rail.rundir import RunError
        raise RunError(f"{e}; the last checkpoint is intact: fix this, then continue with `rail resume {out}`") from None
    from rail.report import format_summary
    print(format_summary(summary, out))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    if a.resume:
        _old_spelling("rail train --resume DIR", "rail resume DIR")
        return cmd_resume(argparse.Namespace(run=a.resume, no_progress=a.no_progress, dry_run=a.dry_run))
    if a.config and not Path(a.config).is_file():
        why = "is a directory" if Path(a.config).is_dir() else "no such file"
        raise UsageError(f"--config {a.config}: {why}; name a TOML file of [section] tables (docs/configuration.md)")
    if a.controller_from:
        trace_of(a.controller_from, "--controller-from")
    cfg = config_from_args(a)  # validated before any directory or model exists
    if a.print_config:
        print(config_toml(cfg), end="")
        return 0
    if a.dry_run:
        return _dry_run_train(cfg)
    from rail.train import start_run
    trainer, out = start_run(cfg, show_progress=not a.no_progress)
    return _run_trainer(trainer, out)


def _read_run_config(run: Path):
    """The config a run was started with (rail/train.py ``read_run_config``, without importing torch)."""
    from rail.config import merge, read_json, validate

    cpath = run / "config.json"
    raw = read_json(cpath, fix="the run's configuration is damaged; restore the file, or start a new run "
                               "with another --out")
    cfg = merge(Config(), raw, str(cpath))
    validate(cfg)
    return cfg


def cmd_resume(a: argparse.Namespace) -> int:
    run = run_dir(a.run)
    if a.dry_run:
        from rail.rundir import has_checkpoint

        cfg = _read_run_config(run)
        latest = run / "checkpoints" / "latest"
        if latest.is_file():
            status = f"would continue from checkpoints/{latest.read_text(encoding='utf-8').strip()}"
        elif has_checkpoint(run):
            status = "would continue from its newest checkpoint"
        else:
            status = "no checkpoint yet: would start again from the beginning"
        if (run / "summary.json").is_file():
            status += "; finished: it has a summary.json"
        _check_envs(cfg)
        print("\n".join(_describe(cfg, run, status)))
        print("dry run: everything checked, nothing written")
        return 0
    from rail.train import resume_run
    trainer, out = resume_run(run, show_progress=not a.no_progress)
    return _run_trainer(trainer, out)


# ---------------------------------------------------------------------------- eval, traces
def cmd_eval(a: argparse.Namespace) -> int:
    if a.checkpoint is not None:
        if a.run is not None:
            raise UsageError("give RUN or --checkpoint, not both (`rail eval RUN`)")
        _old_spelling("rail eval --checkpoint DIR", "rail eval DIR")
        target = checkpoint_target(a.checkpoint, "--checkpoint")
    elif a.run is None:
        raise UsageError("the following arguments are required: RUN (a run directory or one of its checkpoint "
                         "directories); see `rail eval --help`")
    else:
        target = checkpoint_target(a.run)
    from rail.train import eval_checkpoint
    res = eval_checkpoint(target, tasks_per_level=a.tasks_per_level, temperature=a.temperature)
    if a.json:
        print(json.dumps(res, indent=1, sort_keys=True))
    else:
        from rail.report import format_eval
        print(format_eval(res))
    return 0


def cmd_traces(a: argparse.Namespace) -> int:
    from controller.traces import TraceError, evaluate, format_evaluation, show

    path = trace_of(a.run)
    try:
        if a.traces_command == "show":
            print("\n".join(show(path, limit=a.limit, step=a.step)))
            return 0
        res = evaluate(path, policies=a.policy, alpha=a.alpha)
    except TraceError as e:
        print(f"rail: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1) if a.json else format_evaluation(res))
    return 0


# ---------------------------------------------------------------------------- ablate, report
def cmd_ablate(a: argparse.Namespace) -> int:
    from rail.lab.ablate import (
        AblationRunner,
        classify,
        load_ablation,
        make_backend,
        plan_jobs,
    )

    ab = load_ablation(a.config)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()] if a.arms else None
    out = Path(a.out or os.path.join("runs", f"ablate-{ab.name}"))
    jobs = plan_jobs(ab, a.preset, out, arms=arms, seeds=a.seeds, sets=[parse_set(s) for s in a.set],
                     tracking_uri=a.tracking_uri)
    backend = make_backend(a.backend, ab, address=a.address, num_cpus=a.num_cpus, num_gpus=a.num_gpus)
    if a.backend == "ray":
        workers = a.workers or len(jobs)  # the cluster's resources decide how many run at once
    else:
        from rail.cores import usable_cores

        workers = a.workers or max(1, min(len(jobs), usable_cores()))
    if a.dry_run:
        for j in jobs:
            print(f"{classify(j):6s} {j.key:28s} {j.dir}")
        print(f"{len(jobs)} jobs: {backend.describe(workers, backend.threads(workers))}")
        return 0
    try:
        with backend:  # Ray: connects, or starts a local instance, and stops it at the end
            return AblationRunner(ab, jobs, out, a.preset, workers, backend=backend).run(report=not a.no_report)
    except KeyboardInterrupt:
        print(f"rail: interrupted; rerun the same `rail ablate` command to resume ({out})", file=sys.stderr)
        return 130


def cmd_report(a: argparse.Namespace) -> int:
    if a.out is not None and Path(a.out).exists() and not Path(a.out).is_dir():
        raise UsageError(f"--out {a.out}: is a file; name a directory for the report")
    from rail.lab.ablation_report import resolve_target, write_report

    root = resolve_target(a.target, a.tracking_uri)
    dest = Path(a.out) if a.out is not None else root
    rep = write_report(root, out=dest)
    if a.json:
        print(json.dumps(rep, indent=1, sort_keys=True))
    else:
        print(rep["verdict"]["text"])
        print(f"report: {dest / 'report.md'}, {dest / 'report.json'}, figures: {', '.join(rep['figures'])}")
    return 0


# ---------------------------------------------------------------------------- warnings, signals, main
#: the project's packages, whose warnings are rail's own
PACKAGES = tuple(Path(__file__).resolve().parent.parent / p for p in ("rail", "policy", "controller"))


def _ours(filename: str) -> bool:
    parents = Path(filename).resolve().parents
    return any(p in parents for p in PACKAGES)


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning):
    """rail's own warnings (a checkpoint passed over, tracking switched off) as one ``rail: warning:`` line;
    any other library's as Python prints them."""
    if issubclass(category, UserWarning) and _ours(filename):
        print(f"rail: warning: {message}", file=sys.stderr if file is None else file)
    else:
        _default(message, category, filename, lineno, file, line)


_interrupted = False


def _on_sigint(signum, frame):
    """Ctrl-C: remembered, then Python's own KeyboardInterrupt. A Ctrl-C reaches the whole process group, so a
    child (vLLM's engine core) may die of it first and the error that reaches the trainer is the child's death,
    not the interrupt; with the flag set, that error is still an interruption."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


COMMANDS = {"train": cmd_train, "resume": cmd_resume, "eval": cmd_eval, "traces": cmd_traces, "ablate": cmd_ablate,
            "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    global _interrupted
    warnings.showwarning = _show_warning
    _interrupted = False
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = parser.parse_args(argv)
        if a.command is None:  # `rail` alone: what there is to do
            parser.print_help()
            return 0
        return COMMANDS[a.command](a)
    except UsageError as e:
        print(f"rail: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"rail: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rail: interrupted; continue the run with `rail resume RUN`", file=sys.stderr)
        return 130
    except Exception as e:  # known failure kinds get one clear line, not a traceback
        if _interrupted:  # what a Ctrl-C did to a child process (above), after the interrupt itself
            print(f"rail: interrupted ({type(e).__name__} in a child process after Ctrl-C); continue the run with "
                  "`rail resume RUN`", file=sys.stderr)
            return 130
        from rail.rundir import RunError
        known = (RunError, OSError)  # an OSError names its file (a full disk, a missing or unreadable path)
        if "policy.checkpoint" in sys.modules:  # a CheckpointError exists only once it is imported (torch: slow)
            known += (sys.modules["policy.checkpoint"].CheckpointError,)
        if isinstance(e, known):
            print(f"rail: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
