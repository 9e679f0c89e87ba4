# RAIL's own trainer from Python (docs/api.md): build a configuration in code, start a run, train it, read the
# summary. Tracking is off (metrics.jsonl and summary.json are still written); the run goes to --out, or to a new
# temporary directory.
# Run (from the repository root):
#   .venv/bin/python experiments/api_example.py                       # the smoke preset: well under a minute
#   .venv/bin/python experiments/api_example.py --preset default --controller ladder --out runs/api
"""Trains one run through ``rail.train.start_run`` and prints the summary's key figures."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rail.config import build_config
from rail.train import start_run


def key_figures(summary: dict) -> dict:
    """The figures a reader looks at first, from ``summary.json`` (docs/metrics.md, "summary.json")."""
    b, e, iv = summary["budget"], summary["eval"], summary["interventions"]
    return {
        "controller": summary["controller"],
        "steps": summary["steps"],
        "wall_seconds": round(summary["wall_seconds"], 1),
        "budget_spent": b["spent"],
        "intervention_share": iv["budget_share"],
        "easy": [e["easy_initial"], e["easy_final"]],
        "beyond": [e["beyond_initial"], e["beyond_final"]],
        "controller_mode": summary["controller_state"].get("mode"),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="smoke", help="training preset (default: smoke)")
    p.add_argument("--controller", default="rail", help="controller.name (default: rail)")
    p.add_argument("--steps", type=int, default=None, help="run.steps (default: the preset's)")
    p.add_argument("--out", default="", help="run directory (default: a new temporary directory)")
    p.add_argument("--warmstart-cache", default="", help="warmstart.cache_dir (default: the config's)")
    a = p.parse_args(argv)

    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="rail-api-")) / "run"
    overrides = {"run": {"out": str(out)}, "tracking": {"uri": ""}, "controller": {"name": a.controller}}
    if a.steps is not None:
        overrides["run"]["steps"] = a.steps
    if a.warmstart_cache:
        overrides["warmstart"] = {"cache_dir": a.warmstart_cache}
    # build_config(preset, toml, sets): the same precedence as `rail train` (preset < file < flags), validated here
    cfg = build_config(a.preset, sets=[overrides])

    trainer, run_dir = start_run(cfg, show_progress=False)  # takes the run directory's lock, warm-starts
    summary = trainer.run()                                  # trains, evaluates, writes summary.json

    figures = key_figures(summary)
    print(f"run directory: {run_dir}")
    print(f"steps {figures['steps']}, {figures['wall_seconds']} s, controller {figures['controller']} "
          f"(mode: {figures['controller_mode']})")
    spent = figures["budget_spent"]
    print(f"budget: {spent['total']} spent ({spent['base']} base, {spent['intervention']} intervention; "
          f"share {figures['intervention_share']:.3f})")
    print(f"held-out success, easy {figures['easy'][0]:.3f} -> {figures['easy'][1]:.3f}, "
          f"beyond {figures['beyond'][0]:.3f} -> {figures['beyond'][1]:.3f}")
    print("key figures: " + json.dumps(figures, sort_keys=True))
    return figures


if __name__ == "__main__":
    main()
