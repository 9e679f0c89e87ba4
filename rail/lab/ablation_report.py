"""``rail report``: the report of an ablation directory (``rail ablate``'s output), from each child run's
``summary.json`` and ``metrics.jsonl``: ``report.md``, ``report.json`` and PNG figures, written into the
ablation directory and logged to its MLflow parent run. Every field is defined in docs/ablation.md.

This module reads the runs, aggregates them and pairs the arms; the figures are drawn by
:mod:`rail.lab.report_figures` (matplotlib, Agg backend), the markdown written by :mod:`rail.lab.report_markdown`, and
both share :mod:`rail.lab.report_common` (scipy gives the t-intervals over seeds). Torch-free.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from rail.lab import adaptivity
from rail.lab.report_common import (
    MIN_SEEDS,
    RATE,
    RATE_DIFF,
    SHIFT_FIELDS,
    few_seeds,
    mean,
    missing_text,
    n_defined,
    t_interval,
)
from rail.lab.report_figures import draw_figures
from rail.lab.report_markdown import format_markdown

FIXED = ("none", "dapo", "rti", "actguide", "ladder", "random")  # the fixed controllers (rail/controllers.py)
STEP_TIMES = ("time/generate_s", "time/rounds_s", "time/score_s", "time/controller_s", "time/update_s")
#: Per-seed fields that are rates (their intervals lie in [0, 1], their paired differences' in [-1, 1]).
RATE_FIELDS = ("final_beyond", "final_easy", "auc_beyond", "shift_final", "shift_auc")
#: report.md / report.json names of a planned job's state when its run has no summary.json.
JOB_STATES = {"running": "running", "failed": "failed", "interrupted": "interrupted", "pending": "not started",
              "finished": "no summary.json"}
FIGURES = ("learning_curves.png", "final_beyond.png", "choices.png", "how_many.png", "choices_by_level.png")


# ---------------------------------------------------------------------------- statistics (rail/lab/report_common.py)
def _level_mean(success: dict, levels) -> float:
    vals = [rates[str(lv)] for rates in success.values() for lv in levels if str(lv) in rates]
    return float(np.mean(vals)) if vals else float("nan")


# ---------------------------------------------------------------------------- reading runs
def _read_metrics(path: Path) -> list[dict]:
    """Training-step lines of metrics.jsonl, one per step (the last one written wins)."""
    steps: dict[int, dict] = {}
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if "groups/zero_variance_share" in row:
            steps[int(row["step"])] = row
    return [steps[k] for k in sorted(steps)]


class DamagedRun(ValueError):
    """A child run whose summary.json exists but cannot be read; the message names the file and the fix."""


def load_seed_run(run_dir: Path) -> dict | None:
    """What the report needs from one child run; None when it has no summary.json (not finished), a
    :class:`DamagedRun` when its summary.json is damaged."""
    p = run_dir / "summary.json"
    if not p.is_file():
        return None
    try:
        return _seed_run(run_dir, json.loads(p.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise DamagedRun(f"{p}: damaged ({type(e).__name__}: {e}); rerun the same `rail ablate` command to "
                         "write it again from the run's last checkpoint") from None


def _seed_run(run_dir: Path, summary: dict) -> dict:
    try:
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    ev = summary["eval"]
    easy, beyond = ev["easy_levels"], ev["beyond_levels"]
    hist = sorted(ev["history"], key=lambda h: h["step"])

    def as_curve(points: list[dict]) -> dict:
        return {"step": [h["step"] for h in points], "budget_spent": [float(h["budget_spent"]) for h in points],
                "easy": [_level_mean(h["success"], easy) for h in points],
                "beyond": [_level_mean(h["success"], beyond) for h in points]}
    curve = as_curve(hist)
    # the finest curve: the quick evaluations (eval.quick_every) between the full ones, when the run made them
    quick = as_curve(sorted(hist + ev["quick"], key=lambda h: h["step"])) if ev.get("quick") else None
    steps = _read_metrics(run_dir / "metrics.jsonl")
    x, y = np.array(curve["budget_spent"]), np.array(curve["beyond"])
    total = x[-1] if len(x) else 0.0
    if len(x) >= 2 and total > 0 and np.all(np.isfinite(y)):
        auc = float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)) / total)
    else:
        auc = float(y[-1]) if len(y) else None
    zv = [r["groups/zero_variance_share"] for r in steps if r.get("groups/zero_variance_share") is not None]
    step_time = sum(sum(r.get(k) or 0.0 for k in STEP_TIMES) for r in steps)
    ctl = [r["controller/seconds"] for r in steps if r.get("controller/seconds") is not None]
    choices: dict[str, dict[str, list[float]]] = {}
    keys = sorted({m.split("/")[1] for r in steps for m in r
                   if re.match(rf"^intervention/{adaptivity.KEY}/decisions$", m)})
    for key in keys:
        choices[key] = {"decisions": [float(r.get(f"intervention/{key}/decisions") or 0.0) for r in steps],
                        "rollouts": [float(r.get(f"intervention/{key}/rollouts") or 0.0) for r in steps]}
    iv = summary.get("interventions", {})
    by_cell = adaptivity.cell_series(steps)
    shift = adaptivity.shift_of(config)
    follow, logged = None, False
    moved = {"cells": [], "start_step": None, "initial": None, "final": None, "auc": None}
    if shift is not None:
        counts = adaptivity.choice_counts(by_cell, [r["step"] for r in steps], shift)
        follow, logged = adaptivity.steps_to_follow(counts), any(sum(c.values()) > 0 for c in counts)
        moved = adaptivity.shift_success(hist, shift)
    cells = {f"{fam} L{lvl}": float(v) for fam, by_level in sorted(ev.get("final", {}).items())
             for lvl, v in sorted(by_level.items(), key=lambda kv: int(kv[0])) if int(lvl) in beyond}
    return {
        "dir": str(run_dir), "controller": summary.get("controller") or config.get("controller", {}).get("name"),
        "config": config, "summary": summary,
        "easy_levels": easy, "beyond_levels": beyond,
        "final_easy": ev["easy_final"], "final_beyond": ev["beyond_final"], "final_beyond_cells": cells,
        "initial_easy": ev["easy_initial"], "initial_beyond": ev["beyond_initial"],
        "curve": curve, "quick_curve": quick, "auc_beyond": auc,
        "zero_variance_share": float(np.mean(zv)) if zv else None,
        "acceptance": iv.get("acceptance_rate"), "intervention_budget_share": iv.get("budget_share"),
        "wall_seconds": summary.get("wall_seconds"), "budget_spent": summary["budget"]["spent"]["total"],
        "controller_overhead": (ctl[-1] / step_time if ctl and step_time > 0 else 0.0),
        "steps": [r["step"] for r in steps],
        "spent": [float(r.get("budget/spent_total") or 0.0) for r in steps],
        "step_intervention_share": [float(r.get("intervention/budget_share") or 0.0) for r in steps],
        "choices": choices,
        "budget_unit": summary["budget"]["unit"],
        "cells": by_cell, "shift": shift, "steps_to_follow": follow, "choices_after_shift": logged,
        "shift_cells": moved["cells"], "shift_start_step": moved["start_step"], "shift_initial": moved["initial"],
        "shift_final": moved["final"], "shift_auc": moved["auc"],
    }


def load_ablation_dir(root: Path) -> tuple[dict, dict[str, dict[int, dict]]]:
    """(the ablation's state, ``{arm: {seed: run}}``) from an ablation directory. The state's ``damaged`` lists
    the child runs whose summary.json could not be read (each also a warning); they are left out."""
    from rail.config import read_json

    state: dict = {}
    if (root / "ablation.json").is_file():
        state = read_json(root / "ablation.json", fix="rerun the same `rail ablate` command to rewrite it, or delete "
                                                       "it to report every run under the directory")
    state = dict(state, damaged=[], damaged_jobs=[], unfinished_dirs=[])
    arms = list(state.get("arms") or [])
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if d.name not in arms and any((s / "config.json").is_file() for s in d.glob("seed*")):
            arms.append(d.name)
    runs: dict[str, dict[int, dict]] = {}
    for arm in arms:
        runs[arm] = {}
        for s in sorted((root / arm).glob("seed*")):
            m = re.fullmatch(r"seed(\d+)", s.name)
            if not m or not s.is_dir():
                continue
            if state.get("seeds") is not None and int(m.group(1)) not in state["seeds"]:
                continue
            try:
                run = load_seed_run(s)
            except DamagedRun as e:
                import warnings
                warnings.warn(str(e), stacklevel=2)
                state["damaged"].append(str(e))
                state["damaged_jobs"].append(f"{arm}/seed{int(m.group(1))}")
                continue
            if run is not None:
                runs[arm][int(m.group(1))] = run
            elif (s / "config.json").is_file():
                state["unfinished_dirs"].append(f"{arm}/seed{int(m.group(1))}")
    return state, runs


# ---------------------------------------------------------------------------- aggregation
def _aggregate_curve(seed_runs: dict[int, dict]) -> dict:
    """Mean and 95% band over seeds (clipped to [0, 1]; none under 2 seeds), at the evaluation steps every seed
    has, and ``n``, the seeds behind it."""
    common = None
    for r in seed_runs.values():
        s = set(r["curve"]["step"])
        common = s if common is None else common & s
    steps = sorted(common or [])
    out: dict[str, list] = {"step": steps, "budget_spent": [], "easy": [], "easy_ci": [], "beyond": [],
                            "beyond_ci": [], "n": len(seed_runs)}
    for st in steps:
        idx = {sd: r["curve"]["step"].index(st) for sd, r in seed_runs.items()}
        out["budget_spent"].append(mean(r["curve"]["budget_spent"][idx[sd]] for sd, r in seed_runs.items()))
        for k in ("easy", "beyond"):
            vals = [r["curve"][k][idx[sd]] for sd, r in seed_runs.items()]
            out[k].append(mean(vals))
            out[f"{k}_ci"].append(t_interval(vals, bounds=RATE))
    return out


def _aggregate_choices(seed_runs: dict[int, dict]) -> dict:
    """Per how@where: decisions and rollouts per training step (mean over seeds) and totals."""
    n = min((len(r["steps"]) for r in seed_runs.values()), default=0)
    keys = sorted({k for r in seed_runs.values() for k in r["choices"]})
    per: dict[str, dict] = {}
    for k in keys:
        dec = np.mean([np.array(r["choices"].get(k, {"decisions": [0.0] * n})["decisions"][:n]) for r in seed_runs.values()], axis=0)
        rol = np.mean([np.array(r["choices"].get(k, {"rollouts": [0.0] * n})["rollouts"][:n]) for r in seed_runs.values()], axis=0)
        per[k] = {"decisions": dec.tolist(), "rollouts": rol.tolist(),
                  "total_decisions": float(dec.sum()), "total_rollouts": float(rol.sum())}
    steps = next(iter(seed_runs.values()))["steps"][:n] if seed_runs else []
    share = np.mean([np.array(r["step_intervention_share"][:n]) for r in seed_runs.values()], axis=0).tolist() if n else []
    return {"step": steps, "by_key": per, "intervention_budget_share": share}


def _aggregate_cells(seed_runs: dict[int, dict]) -> dict:
    """Per family/level cell: groups, intervened groups and decisions per how@where at each training step, summed
    over seeds (over the steps every seed has), for the figure; and ``totals``: per cell over training, the mean
    over seeds of groups and decisions, the share of groups intervened (pooled) and the most chosen how@where."""
    n = min((len(r["steps"]) for r in seed_runs.values()), default=0)
    names = list(dict.fromkeys(c for r in seed_runs.values() for c in r["cells"]))
    series: dict[str, dict] = {}
    totals: dict[str, dict] = {}
    k = max(len(seed_runs), 1)
    for c in names:
        have = [r["cells"][c] for r in seed_runs.values() if c in r["cells"]]
        grp = np.sum([np.array(x["groups"][:n]) for x in have], axis=0)
        itv = np.sum([np.array(x["intervened"][:n]) for x in have], axis=0)
        keys = sorted({key for x in have for key in x["keys"]})
        dec = {key: np.sum([np.array(x["keys"].get(key, [0.0] * n)[:n]) for x in have], axis=0) for key in keys}
        series[c] = {"family": have[0]["family"], "level": have[0]["level"], "groups": grp.tolist(),
                     "intervened": itv.tolist(), "keys": {key: v.tolist() for key, v in dec.items()}}
        tot = {key: float(v.sum()) / k for key, v in dec.items()}
        totals[c] = {"groups": float(grp.sum()) / k,
                     "intervened_share": float(itv.sum() / grp.sum()) if grp.sum() > 0 else None,
                     "decisions": tot, "dominant": max(tot, key=tot.get) if any(tot.values()) else None}
    steps = next(iter(seed_runs.values()))["steps"][:n] if seed_runs else []
    return {"step": steps, "series": series, "totals": totals}


def _defined(rs: list[dict], field: str) -> list[float]:
    return [r[field] for r in rs if r.get(field) is not None and math.isfinite(r[field])]


def summarize(state: dict, runs: dict[str, dict[int, dict]]) -> dict:
    arms: dict[str, dict] = {}
    for arm, seed_runs in runs.items():
        if not seed_runs:
            continue
        rs = list(seed_runs.values())
        ch = _aggregate_choices(seed_runs)
        cells = _aggregate_cells(seed_runs)
        follow = _defined(rs, "steps_to_follow")
        dec = sum(v["total_decisions"] for v in ch["by_key"].values())
        rol = sum(v["total_rollouts"] for v in ch["by_key"].values())
        arms[arm] = {
            "controller": rs[0]["controller"],
            "description": (state.get("arm_descriptions") or {}).get(arm, ""),
            "seeds": sorted(seed_runs),
            "n_seeds": len(rs),
            "few_seeds": few_seeds(len(rs)),
            "final_beyond": mean(r["final_beyond"] for r in rs),
            "final_beyond_ci": t_interval([r["final_beyond"] for r in rs], bounds=RATE),
            "final_easy": mean(r["final_easy"] for r in rs),
            "final_easy_ci": t_interval([r["final_easy"] for r in rs], bounds=RATE),
            "initial_beyond": mean(r["initial_beyond"] for r in rs),
            "initial_easy": mean(r["initial_easy"] for r in rs),
            "auc_beyond": mean(r["auc_beyond"] for r in rs),
            "auc_beyond_ci": t_interval([r["auc_beyond"] for r in rs], bounds=RATE),
            "budget_to_match_none": None,
            "budget_to_match_none_beyond": None,
            "budget_to_match_none_seeds": [],
            "zero_variance_share": mean(r["zero_variance_share"] for r in rs),
            "acceptance": mean(r["acceptance"] for r in rs),
            "intervention_budget_share": mean(r["intervention_budget_share"] for r in rs),
            "wall_seconds": mean(r["wall_seconds"] for r in rs),
            "controller_overhead": mean(r["controller_overhead"] for r in rs),
            "budget_spent": mean(r["budget_spent"] for r in rs),
            "rollouts_per_decision": rol / dec if dec else None,
            "choices": {k: {"decisions": v["total_decisions"], "rollouts": v["total_rollouts"]}
                        for k, v in ch["by_key"].items()},
            "final_beyond_cells": {c: mean(r["final_beyond_cells"].get(c) for r in rs)
                                   for c in dict.fromkeys(c for r in rs for c in r["final_beyond_cells"])},
            "choices_by_cell": cells["totals"],
            "steps_to_follow": mean(follow),
            "steps_to_follow_ci": t_interval(follow, bounds=(0.0, math.inf)),
            "steps_to_follow_n": len(follow),
            "steps_to_follow_never": sum(1 for r in rs if r["choices_after_shift"] and r["steps_to_follow"] is None),
            "shift_initial": mean(r["shift_initial"] for r in rs),
            "shift_final": mean(r["shift_final"] for r in rs),
            "shift_final_ci": t_interval(_defined(rs, "shift_final"), bounds=RATE),
            "shift_final_n": n_defined(r["shift_final"] for r in rs),
            "shift_auc": mean(r["shift_auc"] for r in rs),
            "shift_auc_ci": t_interval(_defined(rs, "shift_auc"), bounds=RATE),
            "shift_auc_n": n_defined(r["shift_auc"] for r in rs),
            "per_seed": {str(sd): {k: r[k] for k in ("final_easy", "final_beyond", "final_beyond_cells", "auc_beyond",
                                                    "zero_variance_share", "acceptance", "wall_seconds",
                                                    "controller_overhead", "budget_spent", "steps_to_follow",
                                                    "shift_final", "shift_auc")}
                         for sd, r in seed_runs.items()},
            "curve": _aggregate_curve(seed_runs),
            "quick_curve": (_aggregate_curve({sd: dict(r, curve=r["quick_curve"]) for sd, r in seed_runs.items()})
                            if all(r["quick_curve"] for r in rs) else None),
            "_choices_series": ch,
            "_cells_series": cells,
            "_seed_runs": seed_runs,
        }
    target = arms.get("none", {}).get("final_easy")
    target_beyond = arms.get("none", {}).get("final_beyond")
    if "none" in arms:  # paired: each arm against `none` over the seeds both finished
        for a in arms.values():
            seeds = [sd for sd in a["seeds"] if sd in arms["none"]["seeds"]]
            curve = _finest_over(a, seeds)
            none_runs = arms["none"]["_seed_runs"]
            a["budget_to_match_none_seeds"] = seeds
            a["budget_to_match_none_target"] = mean(none_runs[sd]["final_easy"] for sd in seeds)
            a["budget_to_match_none_beyond_target"] = mean(none_runs[sd]["final_beyond"] for sd in seeds)
            a["budget_to_match_none"] = _budget_to_reach(curve, "easy", a["budget_to_match_none_target"])
            a["budget_to_match_none_beyond"] = _budget_to_reach(curve, "beyond", a["budget_to_match_none_beyond_target"])
    failed = []
    for key, e in sorted((state.get("jobs") or {}).items()):
        if e.get("status") in ("failed", "interrupted"):
            failed.append({"job": key, "arm": e.get("arm"), "seed": e.get("seed"), "status": e["status"],
                           "returncode": e.get("returncode"), "error": e.get("error"),
                           "stderr_tail": e.get("stderr_tail", [])})
    listed = list(state.get("arms") or runs)
    order = [a for a in listed if a in arms] + [a for a in arms if a not in listed]
    any_run = next((r for sr in runs.values() for r in sr.values()), None)
    spent = {a: v["budget_spent"] for a, v in arms.items()}
    return {
        "ablation": state.get("name"), "description": state.get("description", ""),
        "preset": state.get("preset"), "config_file": state.get("config_file"),
        "seeds": sorted({s for v in arms.values() for s in v["seeds"]}),
        "arms_order": order,
        "levels": {"easy": any_run["easy_levels"], "beyond": any_run["beyond_levels"]} if any_run else {},
        "eval_tasks_beyond": _eval_tasks(any_run, "beyond_levels"),
        "eval_tasks_easy": _eval_tasks(any_run, "easy_levels"),
        "budget": {"unit": any_run["budget_unit"] if any_run else None, "per_arm": spent,
                   "equal": _equal([v for v in spent.values() if v is not None])},
        "none_final_easy": target, "none_final_beyond": target_beyond,
        "shift": _shift_setting(any_run),
        "arms": arms, "failed": failed,
        "ablation_status": state.get("status"), **_missing_jobs(state, runs, order),
        "arms_missing": [a for a in (state.get("arms") or list(runs)) if a not in arms],
        "damaged": list(state.get("damaged", [])),
    }


def _missing_jobs(state: dict, runs: dict[str, dict[int, dict]], order: list[str]) -> dict:
    """``missing``: every (arm, seed) job the ablation planned (``ablation.json`` ``arms`` x ``seeds`` and its
    ``jobs``, and any run directory on disk) that has no readable summary.json, with its ``state``; and
    ``jobs_planned``, how many jobs that makes with the finished ones."""
    jobs = state.get("jobs") or {}
    planned: dict[tuple[str, int], None] = {}
    for arm in state.get("arms") or []:
        for seed in state.get("seeds") or []:
            planned[(arm, int(seed))] = None
    keys = [*jobs, *state.get("unfinished_dirs", []), *state.get("damaged_jobs", [])]
    for key in keys:
        m = re.fullmatch(r"(.+)/seed(\d+)", key)
        if m:
            planned[(m.group(1), int(m.group(2)))] = None
    for arm, seed_runs in runs.items():
        for seed in seed_runs:
            planned[(arm, seed)] = None
    rank = {a: i for i, a in enumerate([*order, *(state.get("arms") or [])])}
    missing = []
    for arm, seed in sorted(planned, key=lambda k: (rank.get(k[0], len(rank)), k[0], k[1])):
        if seed in runs.get(arm, {}):
            continue
        key = f"{arm}/seed{seed}"
        if key in state.get("damaged_jobs", []):
            st = "damaged summary.json"
        elif key in jobs:
            st = JOB_STATES.get(jobs[key].get("status"), jobs[key].get("status") or "not started")
        else:
            st = "no summary.json" if key in state.get("unfinished_dirs", []) else "not started"
        missing.append({"arm": arm, "seed": seed, "state": st})
    return {"missing": missing, "jobs_planned": len(planned)}


def _finest_over(arm: dict, seeds: list[int]) -> dict:
    """The arm's finest seed-mean curve over some of its seeds only (those another arm shares with it): the
    frequent quick evaluations when its runs made them (``eval.quick_every``), else the full ones."""
    sub = {sd: r for sd, r in arm["_seed_runs"].items() if sd in seeds}
    if not sub:
        return {"step": [], "budget_spent": [], "easy": [], "beyond": []}
    if all(r["quick_curve"] for r in sub.values()):
        return _aggregate_curve({sd: dict(r, curve=r["quick_curve"]) for sd, r in sub.items()})
    return _aggregate_curve(sub)


def _shift_setting(run: dict | None) -> dict | None:
    """The ablation's task-mix shift (every arm shares it: the environments are shared config) and how
    steps_to_follow was measured; None without a shift."""
    if run is None or run["shift"] is None:
        return None
    return {**run["shift"], "cells": run["shift_cells"], "start_step": run["shift_start_step"],
            "tolerance": adaptivity.TOLERANCE, "window": "the trailing fifth of the post-shift steps, at least 1",
            "steady_state": "its choices pooled over the last quarter of the post-shift steps, at least 1"}


def _budget_to_reach(curve: dict, which: str, target: float | None) -> float | None:
    """The budget spent at the first evaluation where the seed-mean ``which`` curve (``easy``, ``beyond``)
    reaches ``target``; None when it never does or there is no target."""
    if target is None or not math.isfinite(target):
        return None
    return next((b for b, v in zip(curve["budget_spent"], curve[which])
                 if v is not None and math.isfinite(v) and v >= target - 1e-9), None)


def _equal(values: list[float], rel: float = 0.01) -> bool:
    """Same spend for every arm (within 1%: a token budget's last group can leave a remainder)."""
    return not values or max(values) - min(values) <= rel * max(abs(max(values)), 1.0)


def _eval_tasks(run: dict | None, which: str) -> int | None:
    if run is None:
        return None
    counts = run["summary"]["eval"].get("tasks")  # held-out tasks per row and level (finite pools hold fewer)
    if counts:
        return sum(n.get(str(lv), 0) for n in counts.values() for lv in run[which])
    c = run["config"]
    fams = len(c.get("env", {}).get("families", [])) or len(run["summary"]["eval"]["final"])
    return fams * len(run[which]) * int(c.get("eval", {}).get("tasks_per_level", 0))


# ---------------------------------------------------------------------------- paired comparisons
def _paired(A: dict, B: dict, field: str, defined: bool = False) -> tuple[float | None, list[float] | None, list]:
    """Mean of arm A's per-seed ``field`` minus arm B's over their common seeds (with ``defined``, only those where
    both arms have it: steps_to_follow is null where a controller never settled), its t-interval (None under 2
    seeds; a difference of rates clipped to [-1, 1]) and the seeds: all arms of a seed share task streams, so the
    comparison is paired."""
    seeds = [s for s in A["seeds"] if s in B["seeds"] and not (defined and (
        A["per_seed"][str(s)].get(field) is None or B["per_seed"][str(s)].get(field) is None))]
    d = [A["per_seed"][str(s)][field] - B["per_seed"][str(s)][field] for s in seeds]
    return mean(d), t_interval(d, bounds=RATE_DIFF if field in RATE_FIELDS else None), seeds


def _paired_fields(A: dict, B: dict, fields: tuple) -> dict:
    """``<field>_diff`` and ``<field>_diff_ci`` (A − B, :func:`_paired`) for each of ``fields``, the
    ``paired_seeds``, their number ``n`` and ``few_seeds`` (0 < n < 3: the intervals are unreliable)."""
    out: dict[str, Any] = {}
    seeds: list = []
    for f in fields:
        out[f"{f}_diff"], out[f"{f}_diff_ci"], seeds = _paired(A, B, f)
    out["paired_seeds"] = seeds
    out["n"], out["few_seeds"] = len(seeds), few_seeds(len(seeds))
    return out


def _ci_words(ci, n: int, nd: int = 3) -> str:
    """An interval in a sentence of report.md, with the seeds behind it."""
    if n == 0:
        return "no paired seed"
    if n == 1 or not ci:
        return "n=1: no interval"
    return (f"95% CI [{ci[0]:+.{nd}f}, {ci[1]:+.{nd}f}] over {n} paired seeds"
            + (", fewer than 3 seeds: interval unreliable" if few_seeds(n) else ""))


# ---------------------------------------------------------------------------- against plain GRPO
def versus_none(rep: dict) -> dict:
    """Does any intervening arm end higher than ``none`` beyond the boundary? Paired over seeds, like ``compare``."""
    arms = rep["arms"]
    out: dict[str, Any] = {"vs": {}, "above_ci": [], "below_ci": [], "few_seeds": [], "answer": None}
    if "none" not in arms or arms["none"]["final_beyond"] is None:
        out["text"] = "No comparison: no finished `none` arm (or no level beyond the boundary was evaluated)."
        return out
    N = arms["none"]
    for a in rep["arms_order"]:
        if a == "none" or arms[a]["final_beyond"] is None:
            continue
        out["vs"][a] = _paired_fields(arms[a], N, ("final_beyond", "final_easy"))
    vs = out["vs"]
    out["above_ci"] = [a for a, v in vs.items() if _decided(v) and v["final_beyond_diff_ci"][0] > 0]
    out["below_ci"] = [a for a, v in vs.items() if _decided(v) and v["final_beyond_diff_ci"][1] < 0]
    out["few_seeds"] = [a for a, v in vs.items() if not _decided(v)]
    if not vs:
        out["answer"] = None
        out["text"] = "No comparison: `none` is the only finished arm."
        return out
    if out["above_ci"]:
        out["answer"] = "yes"
        out["text"] = ("**Yes**: " + ", ".join(
            f"`{a}` ({vs[a]['final_beyond_diff']:+.3f}, {_ci_words(vs[a]['final_beyond_diff_ci'], vs[a]['n'])})"
            for a in out["above_ci"]) + " ends higher than `none` beyond the boundary, the paired interval above 0.")
        return out
    best = max(vs, key=lambda a: vs[a]["final_beyond_diff"] if vs[a]["final_beyond_diff"] is not None else -math.inf)
    largest = (f"the largest mean difference is `{best}`'s {vs[best]['final_beyond_diff']:+.3f} "
               f"({_ci_words(vs[best]['final_beyond_diff_ci'], vs[best]['n'])})"
               if vs[best]["final_beyond_diff"] is not None else "no arm shares a seed with `none`")
    if len(out["below_ci"]) == len(vs):
        out["answer"] = "no"
        out["text"] = ("**No**: every arm's paired interval of final beyond-boundary success minus `none`'s lies "
                       f"below 0; {largest}.")
    elif out["few_seeds"]:
        out["answer"] = "not enough seeds"
        out["text"] = ("**Not enough seeds**: no arm's paired interval of final beyond-boundary success minus `none`'s "
                       f"lies above 0 with at least {MIN_SEEDS} paired seeds, and "
                       + ", ".join(f"`{a}` (n={vs[a]['n']})" for a in out["few_seeds"])
                       + f" {'has' if len(out['few_seeds']) == 1 else 'have'} fewer than {MIN_SEEDS} seeds shared with "
                       f"`none` to tell; {largest}.")
    else:
        out["answer"] = "not shown"
        out["text"] = (f"**Not shown**: no arm's paired interval of final beyond-boundary success minus `none`'s lies "
                       f"above 0 (each over at least {MIN_SEEDS} paired seeds); {largest}.")
    return out


def _decided(d: dict, field: str = "final_beyond") -> bool:
    """Whether a paired comparison (:func:`_paired_fields`) has an interval over at least 3 seeds."""
    return d["n"] >= MIN_SEEDS and d[f"{field}_diff_ci"] is not None


# ---------------------------------------------------------------------------- over other action spaces
def versus_learned(rep: dict) -> dict | None:
    """The learned controller over other action spaces (expressiveness): every other arm whose controller is the
    learned one's, paired against the learned arm (arm − learned) on final and AUC success beyond the boundary and
    final easy success. None when the ablation has no such arm."""
    arms = rep["arms"]
    learned = rep.get("verdict", {}).get("learned", "rail")
    if learned not in arms or arms[learned]["final_beyond"] is None:
        return None
    others = [a for a in rep["arms_order"] if a != learned and arms[a]["controller"] == arms[learned]["controller"]
              and arms[a]["final_beyond"] is not None]
    if not others:
        return None
    L = arms[learned]
    out: dict[str, Any] = {"learned": learned, "vs": {}}
    for a in others:
        out["vs"][a] = _paired_fields(arms[a], L, ("final_beyond", "auc_beyond", "final_easy"))
    vs = out["vs"]
    above = [a for a in others if _decided(vs[a]) and vs[a]["final_beyond_diff_ci"][0] > 0]
    below = [a for a in others if _decided(vs[a]) and vs[a]["final_beyond_diff_ci"][1] < 0]
    few = [a for a in others if not _decided(vs[a])]
    parts = []
    if above:
        parts.append("above `" + learned + "` (paired interval above 0): " + ", ".join(f"`{a}`" for a in above))
    if below:
        parts.append("below it (interval below 0): " + ", ".join(f"`{a}`" for a in below))
    rest = [a for a in others if a not in above and a not in below and a not in few]
    if few:
        parts.append(f"fewer than {MIN_SEEDS} paired seeds to tell: " + ", ".join(f"`{a}` (n={vs[a]['n']})" for a in few))
    if rest:
        parts.append("not told apart from it: " + ", ".join(f"`{a}`" for a in rest))
    out["text"] = (f"The same controller as `{learned}` over other action spaces ({arms[learned]['controller']}), "
                   "final success beyond the boundary: " + "; ".join(parts) + ".")
    return out


# ---------------------------------------------------------------------------- after a task-mix shift
def after_shift(rep: dict, reference: str = "ladder") -> dict | None:
    """With a task-mix shift: each arm's paired differences from ``reference`` (the minimal-intervention heuristic
    the learned controller shadows) in success on the shifted mix after the change and in steps_to_follow, and
    the sentences of report.md; None without a shift."""
    sh = rep.get("shift")
    if sh is None:
        return None
    arms = rep["arms"]
    out: dict[str, Any] = {"reference": reference if reference in arms else None, "vs": {}}
    cells = ", ".join(sh["cells"]) or "none evaluated"
    fams, lvs = ", ".join(f"`{f}`" for f in sh["families"]), ", ".join(map(str, sh["levels"]))
    lines = [f"From training step {sh['step']} on, training tasks are drawn from {fams} at levels {lvs} (held-out "
             f"cells of that mix: {cells}); "
             + (f"success on the shifted mix is measured from the evaluation at step {sh['start_step']}, the last "
                "before the change." if sh["start_step"] is not None else
                "no held-out cell of that mix is evaluated (eval.levels), so there is no success on it to report.")]
    if out["reference"] is None:
        lines.append(f"No `{reference}` arm: no paired differences.")
    else:
        R = arms[reference]
        for a in rep["arms_order"]:
            if a == reference:
                continue
            d = {}
            for f in SHIFT_FIELDS:
                m, ci, seeds = _paired(arms[a], R, f, defined=True)
                d[f"{f}_diff"], d[f"{f}_diff_ci"], d[f"{f}_paired_seeds"] = m, ci, seeds
                d[f"{f}_n"], d[f"{f}_few_seeds"] = len(seeds), few_seeds(len(seeds))
            out["vs"][a] = d
        learned = rep.get("verdict", {}).get("learned")
        if learned in out["vs"]:
            d = out["vs"][learned]
            part = []
            for f, what in (("shift_final", "final success on the shifted mix"), ("shift_auc", "its AUC after the shift"),
                            ("steps_to_follow", "steps to follow")):
                if d[f"{f}_diff"] is None:
                    part.append(f"{what}: no paired seed")
                    continue
                nd = 1 if f == "steps_to_follow" else 3
                part.append(f"{what} {d[f'{f}_diff']:+.{nd}f} ({_ci_words(d[f'{f}_diff_ci'], d[f'{f}_n'], nd)})")
            lines.append(f"`{learned}` − `{reference}`, paired over seeds: " + "; ".join(part) + ".")
    never = [a for a in rep["arms_order"] if arms[a].get("steps_to_follow_never")]
    if never:
        lines.append("Never settled within the tolerance by the end of the run (seeds): "
                     + ", ".join(f"`{a}` ({arms[a]['steps_to_follow_never']})" for a in never) + ".")
    out["text"] = " ".join(lines)
    return out


# ---------------------------------------------------------------------------- against the best fixed rule
def versus_best_fixed(rep: dict) -> dict | None:
    """The learned arm against the best fixed rule in hindsight: of the arms whose controller is a fixed one (every
    fixed heuristic, every one- and two-rung ladder, a per-cell rule), the one with the highest mean final success
    beyond the boundary; paired over seeds on final and AUC success beyond the boundary and final easy success,
    and the budget at which each arm's seed-mean beyond curve first reaches its final beyond success
    (``budget_to_match_best_fixed_beyond``). None without a learned and a fixed arm."""
    arms = rep["arms"]
    learned = rep.get("verdict", {}).get("learned", "rail")
    fixed = [a for a in rep["arms_order"] if arms[a]["controller"] in FIXED and arms[a]["final_beyond"] is not None]
    if learned not in arms or arms[learned]["final_beyond"] is None or not fixed:
        return None
    best = max(fixed, key=lambda a: (arms[a]["final_beyond"], arms[a]["final_easy"] or 0.0))
    B, L = arms[best], arms[learned]
    target = B["final_beyond"]
    best_runs = B["_seed_runs"]
    for a in arms.values():  # paired: over the seeds the arm shares with the best fixed rule
        seeds = [sd for sd in a["seeds"] if sd in B["seeds"]]
        a["budget_to_match_best_fixed_beyond_seeds"] = seeds
        a["budget_to_match_best_fixed_beyond"] = _budget_to_reach(
            _finest_over(a, seeds), "beyond", mean(best_runs[sd]["final_beyond"] for sd in seeds))
    d = _paired_fields(L, B, ("final_beyond", "auc_beyond", "final_easy"))
    ci = d["final_beyond_diff_ci"]
    n = d["n"]
    how = ("no paired seed" if n == 0 else f"{d['final_beyond_diff']:+.3f}, {_ci_words(ci, n)}")
    if _decided(d) and ci[0] > 0:
        head = f"`{learned}` ends above it beyond the boundary ({how})."
    elif _decided(d) and ci[1] < 0:
        head = f"`{learned}` ends below it beyond the boundary ({how})."
    elif not _decided(d):
        head = f"`{learned}` has too few seeds in common with it to tell them apart beyond the boundary ({how})."
    else:
        head = f"`{learned}` is not told apart from it beyond the boundary ({how})."
    spent = L["budget_to_match_best_fixed_beyond"]
    total = L["budget_spent"]
    shared = L["budget_to_match_best_fixed_beyond_seeds"]
    tgt = mean(best_runs[sd]["final_beyond"] for sd in shared)
    over = ("" if len(shared) == B["n_seeds"] else
            f", over the {len(shared)} seed{'s' if len(shared) != 1 else ''} both finished")
    reach = ("" if tgt is None else
             f"`{learned}` first reached `{best}`'s final beyond success ({tgt:.3f}{over}) after {spent:.0f} budget units"
             + (f" ({spent / total:.0%} of its budget)." if total else ".") if spent is not None else
             f"`{learned}` never reached `{best}`'s final beyond success ({tgt:.3f}{over}) at an evaluation.")
    return {"best": best, "learned": learned, "best_final_beyond": target, **d,
            "budget_to_match": spent, "budget_share_to_match": spent / total if spent is not None and total else None,
            "budget_to_match_seeds": shared,
            "text": f"The best fixed rule in hindsight is `{best}` ({B['description'] or B['controller']}; final "
                    f"success beyond the boundary {target:.3f}, n={B['n_seeds']}). {head} {reach}".rstrip()}


# ---------------------------------------------------------------------------- the verdict
def compare(rep: dict, learned: str = "rail") -> dict:
    """Is the learned arm above every fixed heuristic beyond the boundary at equal budget?"""
    arms = rep["arms"]
    if learned not in arms:
        cand = [a for a, v in arms.items() if v["controller"] == "rail"]
        learned = cand[0] if cand else learned
    fixed = [a for a in rep["arms_order"] if arms[a]["controller"] in FIXED]
    out: dict[str, Any] = {"learned": learned, "fixed": fixed, "vs": {}}
    if learned not in arms or not fixed or any(arms[a]["final_beyond"] is None for a in [learned, *fixed]):
        out["text"] = ("No comparison: " + (f"no finished `{learned}` arm" if learned not in arms
                                             else "no finished fixed-controller arm" if not fixed
                                             else "no level beyond the boundary was evaluated (eval.levels)") + ".")
        out.update(beats_all_mean=None, beats_all_ci=None, less_budget_than_all=None,
                   less_budget_than_all_beyond=None, answer=None, below_ci=[], few_seeds=[])
        return out
    L = arms[learned]
    for f in fixed:
        out["vs"][f] = _paired_fields(L, arms[f], ("final_beyond", "auc_beyond"))
    vs = out["vs"]
    above = [f for f in fixed if (vs[f]["final_beyond_diff"] or 0.0) > 0]
    sig = [f for f in fixed if _decided(vs[f]) and vs[f]["final_beyond_diff_ci"][0] > 0]
    below = [f for f in fixed if _decided(vs[f]) and vs[f]["final_beyond_diff_ci"][1] < 0]
    few = [f for f in fixed if not _decided(vs[f])]
    out["beats_all_mean"] = len(above) == len(fixed)
    out["beats_all_ci"] = len(sig) == len(fixed)
    out["below_ci"], out["few_seeds"] = below, few
    best = max(fixed, key=lambda f: arms[f]["final_beyond"])
    one_task = (1.0 / rep["eval_tasks_beyond"]) if rep.get("eval_tasks_beyond") else None
    lines = []
    equal = "at equal budget" if rep["budget"]["equal"] else "(note: budget spent differs between arms, see the table)"
    ns = sorted({vs[f]["n"] for f in fixed})
    over = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}–{ns[-1]}"
    means = (f"means alone (no conclusion): `{learned}` {L['final_beyond']:.3f} (n={L['n_seeds']}) is "
             + ("above every fixed heuristic's" if out["beats_all_mean"] else
                "not above " + ", ".join(f"`{f}` ({arms[f]['final_beyond']:.3f}, n={arms[f]['n_seeds']})"
                                         for f in fixed if f not in above)))
    if out["beats_all_ci"]:
        out["answer"] = "yes"
        lines.append(f"**Yes**: `{learned}` ends with higher held-out success beyond the boundary than every fixed "
                     f"heuristic {equal}: {L['final_beyond']:.3f} vs at most {arms[best]['final_beyond']:.3f} "
                     f"(`{best}`), every paired 95% interval over {over} seeds above 0.")
    elif below:
        out["answer"] = "no"
        lines.append(f"**No**: {equal}, `{learned}` ends below "
                     + ", ".join(f"`{f}` ({vs[f]['final_beyond_diff']:+.3f}, "
                                 f"{_ci_words(vs[f]['final_beyond_diff_ci'], vs[f]['n'])})" for f in below)
                     + " beyond the boundary, the paired interval below 0.")
    elif few:
        out["answer"] = "not enough seeds"
        lines.append(f"**Not enough seeds**: {equal}, the paired comparison of `{learned}` with "
                     + ", ".join(f"`{f}` (n={vs[f]['n']})" for f in few)
                     + f" has fewer than {MIN_SEEDS} seeds both finished, too few for its interval to decide; "
                     + means + ".")
    else:
        out["answer"] = "not shown"
        lines.append(f"**Not shown**: {equal}, the paired 95% interval of `{learned}` − arm over {over} seeds "
                     "includes 0 against " + ", ".join(f"`{f}`" for f in fixed if f not in sig)
                     + (f", lies above 0 against {', '.join(f'`{f}`' for f in sig)}" if sig else "")
                     + " and lies below 0 against no arm; " + means + ".")
    top = max(arms[a]["final_beyond"] for a in arms)
    if one_task is not None and top < 0.05:
        lines.append(f"Beyond-boundary success is near zero for every arm (highest {top:.3f}); one held-out task "
                     f"moves that rate by {one_task:.4f} ({rep['eval_tasks_beyond']} tasks per evaluation), so these "
                     "differences amount to a few tasks.")
    # budget to reach the none arm's final success, on the easy levels and beyond the boundary
    # (each arm paired with `none` over the seeds both finished: the target is `none`'s mean over those seeds)
    shared = L.get("budget_to_match_none_seeds") or []
    over = ("" if "none" not in arms or len(shared) == arms["none"]["n_seeds"] else
            f", over the {len(shared)} seed{'s' if len(shared) != 1 else ''} it shares with `none`")
    for which, field, target, flag in (
            ("easy-level", "budget_to_match_none", L.get("budget_to_match_none_target"), "less_budget_than_all"),
            ("beyond-boundary", "budget_to_match_none_beyond", L.get("budget_to_match_none_beyond_target"),
             "less_budget_than_all_beyond")):
        out[flag] = None
        if rep.get(f"none_final_{'easy' if which == 'easy-level' else 'beyond'}") is None:
            continue
        if target is None or not math.isfinite(target):
            continue
        need = {a: arms[a].get(field) for a in [learned, *fixed] if a in arms}
        ln = need.get(learned)
        others = {f: need[f] for f in fixed if f != "none"}
        less = ln is not None and all(v is None or ln < v for v in others.values())
        out[flag] = less if others else None
        theirs = ", ".join(f"`{f}` {'never' if v is None else f'{v:.0f}'}" for f, v in others.items())
        if ln is None:
            lines.append(f"`{learned}` never reached the `none` arm's final {which} success "
                         f"({target:.3f}{over}) at an evaluation" + (f" (the others: {theirs})." if theirs else "."))
        else:
            lines.append(f"`{learned}` first reached the `none` arm's final {which} success "
                         f"({target:.3f}{over}) after {ln:.0f} budget units"
                         + (f"; the other fixed heuristics: {theirs}" + (", so it needed the least budget." if less else ".")
                            if theirs else "."))
    missing = [a for a in rep.get("arms_missing", []) if a not in arms]
    if missing:
        lines.append("Not compared (no finished run): " + ", ".join(f"`{a}`" for a in missing) + ".")
    if rep.get("missing"):
        lines.append(f"Over the finished runs only: {len(rep['missing'])} of {rep['jobs_planned']} planned jobs have no "
                     "summary.json (listed at the top of report.md).")
    out["text"] = " ".join(lines)
    return out


# ---------------------------------------------------------------------------- entry points
def write_report(root: Path, parent=None, figures: bool = True, out: Path | None = None) -> dict:
    """Write report.md, report.json and the figures into ``out`` (default: ``root``, the ablation directory);
    log them to the parent run if any."""
    from policy.fileio import write_text_atomic

    root = Path(root)
    state, runs = load_ablation_dir(root)
    rep = summarize(state, runs)
    if not rep["arms"]:
        from rail.config import ConfigError
        files = [d.split(": damaged (")[0] for d in state["damaged"]]
        damaged = f"; damaged, rerun the `rail ablate` command to rewrite them: {', '.join(files)}" if files else ""
        raise ConfigError(f"{root}: no finished run (no readable <arm>/seed<k>/summary.json){damaged}; nothing to report")
    rep["verdict"] = compare(rep)
    if rep["damaged"]:  # whatever the comparison says, it says it without these runs
        rep["verdict"]["text"] += " Left out, damaged: " + "; ".join(rep["damaged"])
    rep["versus_none"] = versus_none(rep)
    rep["versus_learned"] = versus_learned(rep)
    rep["versus_best_fixed"] = versus_best_fixed(rep)
    rep["after_shift"] = after_shift(rep)
    for a in rep["arms"].values():  # the runs themselves: every paired figure is computed by now
        a.pop("_seed_runs", None)
    if rep["missing"]:
        import warnings
        warnings.warn(f"{root}: {missing_text(rep)}; the report covers the finished runs only", stacklevel=2)
    dest = root if out is None else Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    rep["figures"] = draw_figures(rep, dest) if figures else []
    public = json.loads(json.dumps(rep, default=float))
    for a in public["arms"].values():
        a.pop("_choices_series", None)
        a.pop("_cells_series", None)
    write_text_atomic(dest / "report.json", json.dumps(public, indent=1, sort_keys=True))
    write_text_atomic(dest / "report.md", format_markdown(rep))
    _log_to_parent(dest, state, public, parent)
    return public


def _log_to_parent(root: Path, state: dict, rep: dict, parent) -> None:
    files = [root / "report.md", root / "report.json", *[root / f for f in rep["figures"]]]
    metrics = {}
    for a, v in rep["arms"].items():
        for k in ("final_beyond", "final_easy", "auc_beyond", "zero_variance_share", "acceptance", "wall_seconds",
                  "controller_overhead", "budget_to_match_none", "budget_to_match_none_beyond",
                  "steps_to_follow", "shift_final", "shift_auc"):
            if isinstance(v.get(k), (int, float)) and math.isfinite(v[k]):
                metrics[f"report/{a}/{k}"] = float(v[k])
    if parent is not None:
        parent._call(lambda t: [t.log_artifact(f) for f in files])
        parent._call(lambda t: t.log_metrics(metrics, 0))
        return
    rid, uri = state.get("parent_run_id"), state.get("parent_tracking_uri") or state.get("tracking_uri")
    if not rid or not uri:
        return
    try:
        import mlflow
        from mlflow.entities import Metric

        client = mlflow.MlflowClient(tracking_uri=uri)
        for f in files:
            client.log_artifact(rid, str(f))
        import time
        ts = int(time.time() * 1000)
        client.log_batch(rid, metrics=[Metric(k, v, ts, 0) for k, v in metrics.items()])
    except Exception as e:  # noqa: BLE001 - the files on disk are the report; tracking is a copy
        import warnings
        warnings.warn(f"report not logged to MLflow run {rid} ({type(e).__name__}: {e}); the files are in {root}",
                      stacklevel=2)


def resolve_target(target: str, tracking_uri: str | None) -> Path:
    """An ablation directory, or an MLflow parent run id / experiment name whose parent run names its directory."""
    p = Path(target)
    if p.is_dir():
        return p
    from rail.config import ConfigError

    if not tracking_uri:
        raise ConfigError(f"{target}: no such directory (pass an ablation directory, or --tracking-uri to look up "
                          "an MLflow parent run id or experiment)")
    try:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        try:
            run = client.get_run(target)
            d = run.data.tags.get("rail.ablation.dir")
        except Exception:  # noqa: BLE001 - not a run id: an experiment name
            exp = client.get_experiment_by_name(target)
            if exp is None:
                raise ConfigError(f"{target}: neither a directory, an MLflow run id nor an experiment in {tracking_uri}") from None
            runs = client.search_runs([exp.experiment_id], filter_string="tags.`rail.ablation.dir` != ''",
                                      order_by=["attributes.start_time DESC"], max_results=1)
            d = runs[0].data.tags.get("rail.ablation.dir") if runs else None
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{target}: MLflow lookup in {tracking_uri} failed ({type(e).__name__}: {e})") from None
    if not d or not Path(d).is_dir():
        raise ConfigError(f"{target}: the MLflow run names no ablation directory on this machine ({d!r})")
    return Path(d)
