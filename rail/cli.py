"""``rail``: the command line. Arguments and config are parsed before torch is imported, so ``--help`` and
config errors are instant and a bad config never creates an output directory (``rail ablate`` checks every
arm's config before it starts anything)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import warnings
from pathlib import Path

from rail.config import ConfigError, build_config, load_toml, parse_set


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="post-train a policy with GRPO under a rollout budget",
                       description="Config precedence: defaults < --preset < --config TOML < flags < --set.")
    p.add_argument("--preset", default="default", help="named preset: default (CPU demo), smoke (tests)")
    p.add_argument("--config", help="TOML file with [section] tables of config keys")
    p.add_argument("--steps", type=int, help="run.steps")
    p.add_argument("--budget", type=int, help="budget.rollouts_per_step (or tokens_per_step with unit=tokens)")
    p.add_argument("--group-size", type=int, help="budget.group_size")
    p.add_argument("--controller", help="controller.name")
    p.add_argument("--controller-from", metavar="RUN", help="controller.init_from: start the learned controller from "
                                                             "an earlier run's (its decision trace)")
    p.add_argument("--seed", type=int, help="run.seed")
    p.add_argument("--model", help="model.path: a Hugging Face model directory")
    p.add_argument("--out", help="run.out (default runs/<run.name>)")
    p.add_argument("--tracking-uri", help="tracking.uri ('' disables MLflow)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any field, e.g. learner.lr=5e-4")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint on the held-out tasks")
    p.add_argument("--checkpoint", required=True, help="a run directory or one of its checkpoint directories")
    p.add_argument("--tasks-per-level", type=int, help="eval.tasks_per_level")
    p.add_argument("--temperature", type=float, help="eval.temperature (0: greedy)")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")


def _traces_parser(sub) -> None:
    p = sub.add_parser("traces", help="work with the learned controller's decision traces")
    tsub = p.add_subparsers(dest="traces_command", required=True)
    e = tsub.add_parser("evaluate", help="off-policy estimates (IPS, SNIPS, DR) over a trace")
    e.add_argument("path", help="a decisions.dsjson file, or a run directory holding traces/decisions.dsjson")
    e.add_argument("--policy", action="append", default=[], metavar="HOW@WHERE",
                   help="also evaluate the fixed rule 'this intervention when legal' (repeatable)")
    e.add_argument("--alpha", type=float, default=0.05, help="1 - confidence level of the intervals")
    e.add_argument("--json", action="store_true", help="print the result as JSON only")


def _ablate_parser(sub) -> None:
    p = sub.add_parser("ablate", help="run a controller ablation: every arm x seed under one budget, tracked in MLflow",
                       description="Runs every (arm, seed) of an ablation file (docs/ablation.md) as `rail train` "
                                   "worker processes or Ray tasks; rerunning skips finished pairs and resumes killed "
                                   "ones.")
    p.add_argument("--config", required=True, help="ablation TOML file, e.g. experiments/ablations/controllers.toml")
    p.add_argument("--seeds", type=int, help="run seeds 0..N-1 (default: the file's ablation.seeds)")
    p.add_argument("--workers", type=int, help="parallel training processes (default: one per core, at most the jobs); "
                                               "each gets cores // workers torch threads. With --backend ray: at "
                                               "most this many jobs submitted at once (default: all)")
    p.add_argument("--backend", choices=("process", "ray"), default="process",
                   help="where jobs run: worker processes here, or Ray tasks (needs the ray extra)")
    p.add_argument("--address", help="--backend ray: join this Ray cluster (HOST:PORT, or auto) instead of starting "
                                     "a local Ray instance")
    p.add_argument("--num-cpus", type=float, help="--backend ray: CPUs per job (resources.num_cpus, default 1); "
                                                  "the job trains with that many threads")
    p.add_argument("--num-gpus", type=float, help="--backend ray: GPUs per job (resources.num_gpus, default 0)")
    p.add_argument("--preset", default="default", help="training preset of every arm: default, smoke (seconds per run)")
    p.add_argument("--out", help="output directory (default runs/ablate-<name>); runs go in <out>/<arm>/seed<k>/")
    p.add_argument("--tracking-uri", help="tracking.uri of every run ('' disables MLflow)")
    p.add_argument("--arms", help="comma-separated subset of the file's arms")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config field for every arm (before the arms' own controller settings)")
    p.add_argument("--dry-run", action="store_true", help="print the jobs and what would be done, run nothing")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="report of an ablation: report.md, report.json and figures")
    p.add_argument("target", metavar="EXPERIMENT_OR_DIR",
                   help="an ablation output directory, or (with --tracking-uri) its MLflow parent run id or experiment")
    p.add_argument("--tracking-uri", help="MLflow tracking URI to look up a run id or experiment")
    p.add_argument("--json", action="store_true", help="print report.json instead of the verdict")


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


def cmd_train(a: argparse.Namespace) -> int:
    if a.resume:
        from rail.train import resume_run
        trainer, out = resume_run(Path(a.resume), show_progress=not a.no_progress)
    else:
        cfg = config_from_args(a)  # validated before any directory or model exists
        from rail.train import start_run
        trainer, out = start_run(cfg, show_progress=not a.no_progress)
    try:
        summary = trainer.run()
    except OSError as e:  # a full disk, a directory gone: checkpoints are written atomically, so the last one holds
        from rail.rundir import RunError
        raise RunError(f"{e}; the last checkpoint is intact: fix this, then resume with "
                       f"`rail train --resume {out}`") from None
    from rail.report import format_summary
    print(format_summary(summary, out))
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from rail.train import eval_checkpoint
    res = eval_checkpoint(Path(a.checkpoint), tasks_per_level=a.tasks_per_level, temperature=a.temperature)
    if a.json:
        print(json.dumps(res, indent=1, sort_keys=True))
    else:
        from rail.report import format_eval
        print(format_eval(res))
    return 0


def cmd_traces(a: argparse.Namespace) -> int:
    from controller.traces import TraceError, evaluate, format_evaluation
    path = Path(a.path)
    if path.is_dir():
        path = path / "traces" / "decisions.dsjson" if (path / "traces").is_dir() else path / "decisions.dsjson"
    try:
        res = evaluate(path, policies=a.policy, alpha=a.alpha)
    except TraceError as e:
        print(f"rail: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1) if a.json else format_evaluation(res))
    return 0


def cmd_ablate(a: argparse.Namespace) -> int:
    import os

    from rail.lab.ablate import AblationRunner, classify, load_ablation, make_backend, plan_jobs

    ab = load_ablation(a.config)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()] if a.arms else None
    if a.seeds is not None and a.seeds < 1:
        raise ConfigError(f"--seeds {a.seeds}: must be >= 1")
    if a.workers is not None and a.workers < 1:
        raise ConfigError(f"--workers {a.workers}: must be >= 1")
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
    from rail.lab.ablation_report import resolve_target, write_report

    root = resolve_target(a.target, a.tracking_uri)
    rep = write_report(root)
    if a.json:
        print(json.dumps(rep, indent=1, sort_keys=True))
    else:
        print(rep["verdict"]["text"])
        print(f"report: {root / 'report.md'}, {root / 'report.json'}, figures: {', '.join(rep['figures'])}")
    return 0


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


def main(argv: list[str] | None = None) -> int:
    global _interrupted
    warnings.showwarning = _show_warning
    _interrupted = False
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    parser = argparse.ArgumentParser(prog="rail", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    _train_parser(sub)
    _eval_parser(sub)
    _traces_parser(sub)
    _ablate_parser(sub)
    _report_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["train"]  # `rail` alone runs the default demonstration
    a = parser.parse_args(argv)
    if a.command is None:
        a = parser.parse_args(["train", *argv])
    try:
        return {"train": cmd_train, "eval": cmd_eval, "traces": cmd_traces, "ablate": cmd_ablate,
                "report": cmd_report}[a.command](a)
    except ConfigError as e:
        print(f"rail: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rail: interrupted; resume with `rail train --resume DIR`", file=sys.stderr)
        return 130
    except Exception as e:  # known failure kinds get one clear line, not a traceback
        if _interrupted:  # what a Ctrl-C did to a child process (above), after the interrupt itself
            print(f"rail: interrupted ({type(e).__name__} in a child process after Ctrl-C); resume with "
                  "`rail train --resume DIR`", file=sys.stderr)
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
