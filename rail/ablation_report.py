"""``rail report``: the report of an ablation directory (``rail ablate``'s output), from each child run's
``summary.json`` and ``metrics.jsonl``: ``report.md``, ``report.json`` and PNG figures, written into the
ablation directory and logged to its MLflow parent run. Every field is defined in docs/ablation.md.

Torch-free; matplotlib (Agg backend) draws the figures, scipy gives the t-intervals over seeds.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from rail import adaptivity

FIXED = ("none", "dapo", "rti", "actguide", "ladder", "random")  # the fixed controllers (rail/controllers.py)
STEP_TIMES = ("time/generate_s", "time/score_s", "time/controller_s", "time/update_s")
FIGURES = ("learning_curves.png", "final_beyond.png", "choices.png", "how_many.png", "choices_by_level.png")


# ---------------------------------------------------------------------------- statistics
def t_interval(values, alpha: float = 0.05) -> list[float] | None:
    """Two-sided (1 - alpha) t-interval of the mean over seeds; [x, x] for one value; None for none."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return None
    m = float(np.mean(v))
    if len(v) < 2:
        return [m, m]
    from scipy import stats

    half = float(stats.t.ppf(1 - alpha / 2, len(v) - 1) * np.std(v, ddof=1) / math.sqrt(len(v)))
    return [m - half, m + half]


def _mean(values) -> float | None:
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def _level_mean(success: dict, levels) -> float:
    vals = [rates[str(lv)] for rates in success.values() for lv in levels if str(lv) in rates]
    return float(np.mean(vals)) if vals else float("nan")


def _smooth(y: np.ndarray, w: int) -> np.ndarray:
    if w <= 1 or len(y) < w:
        return y
    k = np.ones(w) / w
    pad = np.concatenate([np.full(w // 2, y[0]), y, np.full(w - 1 - w // 2, y[-1])])
    return np.convolve(pad, k, mode="valid")


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
    curve = {"step": [h["step"] for h in hist], "budget_spent": [float(h["budget_spent"]) for h in hist],
             "easy": [_level_mean(h["success"], easy) for h in hist],
             "beyond": [_level_mean(h["success"], beyond) for h in hist]}
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
        "curve": curve, "auc_beyond": auc,
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
    state = dict(state, damaged=[])
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
                continue
            if run is not None:
                runs[arm][int(m.group(1))] = run
    return state, runs


# ---------------------------------------------------------------------------- aggregation
def _aggregate_curve(seed_runs: dict[int, dict]) -> dict:
    """Mean and 95% band over seeds, at the evaluation steps every seed has."""
    common = None
    for r in seed_runs.values():
        s = set(r["curve"]["step"])
        common = s if common is None else common & s
    steps = sorted(common or [])
    out: dict[str, list] = {"step": steps, "budget_spent": [], "easy": [], "easy_ci": [], "beyond": [],
                            "beyond_ci": []}
    for st in steps:
        idx = {sd: r["curve"]["step"].index(st) for sd, r in seed_runs.items()}
        out["budget_spent"].append(_mean(r["curve"]["budget_spent"][idx[sd]] for sd, r in seed_runs.items()))
        for k in ("easy", "beyond"):
            vals = [r["curve"][k][idx[sd]] for sd, r in seed_runs.items()]
            out[k].append(_mean(vals))
            out[f"{k}_ci"].append(t_interval(vals))
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
            "final_beyond": _mean(r["final_beyond"] for r in rs),
            "final_beyond_ci": t_interval([r["final_beyond"] for r in rs]),
            "final_easy": _mean(r["final_easy"] for r in rs),
            "final_easy_ci": t_interval([r["final_easy"] for r in rs]),
            "initial_beyond": _mean(r["initial_beyond"] for r in rs),
            "initial_easy": _mean(r["initial_easy"] for r in rs),
            "auc_beyond": _mean(r["auc_beyond"] for r in rs),
            "auc_beyond_ci": t_interval([r["auc_beyond"] for r in rs]),
            "budget_to_match_none": None,
            "budget_to_match_none_beyond": None,
            "zero_variance_share": _mean(r["zero_variance_share"] for r in rs),
            "acceptance": _mean(r["acceptance"] for r in rs),
            "intervention_budget_share": _mean(r["intervention_budget_share"] for r in rs),
            "wall_seconds": _mean(r["wall_seconds"] for r in rs),
            "controller_overhead": _mean(r["controller_overhead"] for r in rs),
            "budget_spent": _mean(r["budget_spent"] for r in rs),
            "rollouts_per_decision": rol / dec if dec else None,
            "choices": {k: {"decisions": v["total_decisions"], "rollouts": v["total_rollouts"]}
                        for k, v in ch["by_key"].items()},
            "final_beyond_cells": {c: _mean(r["final_beyond_cells"].get(c) for r in rs)
                                   for c in dict.fromkeys(c for r in rs for c in r["final_beyond_cells"])},
            "choices_by_cell": cells["totals"],
            "steps_to_follow": _mean(follow),
            "steps_to_follow_ci": t_interval(follow),
            "steps_to_follow_never": sum(1 for r in rs if r["choices_after_shift"] and r["steps_to_follow"] is None),
            "shift_initial": _mean(r["shift_initial"] for r in rs),
            "shift_final": _mean(r["shift_final"] for r in rs),
            "shift_final_ci": t_interval(_defined(rs, "shift_final")),
            "shift_auc": _mean(r["shift_auc"] for r in rs),
            "shift_auc_ci": t_interval(_defined(rs, "shift_auc")),
            "per_seed": {str(sd): {k: r[k] for k in ("final_easy", "final_beyond", "final_beyond_cells", "auc_beyond",
                                                    "zero_variance_share", "acceptance", "wall_seconds",
                                                    "controller_overhead", "budget_spent", "steps_to_follow",
                                                    "shift_final", "shift_auc")}
                         for sd, r in seed_runs.items()},
            "curve": _aggregate_curve(seed_runs),
            "_choices_series": ch,
            "_cells_series": cells,
        }
    target = arms.get("none", {}).get("final_easy")
    target_beyond = arms.get("none", {}).get("final_beyond")
    for a in arms.values():
        a["budget_to_match_none"] = _budget_to_reach(a["curve"], "easy", target)
        a["budget_to_match_none_beyond"] = _budget_to_reach(a["curve"], "beyond", target_beyond)
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
        "arms_missing": [a for a in (state.get("arms") or list(runs)) if a not in arms],
        "damaged": list(state.get("damaged", [])),
    }


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
def _paired(A: dict, B: dict, field: str) -> tuple[float | None, list[float] | None, list]:
    """Mean of arm A's per-seed ``field`` minus arm B's over their common seeds, its t-interval (None under 2
    seeds) and the seeds: all arms of a seed share task streams, so the comparison is paired."""
    seeds = [s for s in A["seeds"] if s in B["seeds"]]
    d = [A["per_seed"][str(s)][field] - B["per_seed"][str(s)][field] for s in seeds]
    return _mean(d), (t_interval(d) if len(d) >= 2 else None), seeds


def _ci(ci) -> str:
    return "–" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


# ---------------------------------------------------------------------------- against plain GRPO
def versus_none(rep: dict) -> dict:
    """Does any intervening arm end higher than ``none`` beyond the boundary? Paired over seeds, like ``compare``."""
    arms = rep["arms"]
    out: dict[str, Any] = {"vs": {}, "above_ci": []}
    if "none" not in arms or arms["none"]["final_beyond"] is None:
        out["text"] = "No comparison: no finished `none` arm (or no level beyond the boundary was evaluated)."
        return out
    N = arms["none"]
    for a in rep["arms_order"]:
        if a == "none" or arms[a]["final_beyond"] is None:
            continue
        db, db_ci, paired = _paired(arms[a], N, "final_beyond")
        de, de_ci, _ = _paired(arms[a], N, "final_easy")
        out["vs"][a] = {"final_beyond_diff": db, "final_beyond_diff_ci": db_ci,
                        "final_easy_diff": de, "final_easy_diff_ci": de_ci, "paired_seeds": paired}
    out["above_ci"] = [a for a, v in out["vs"].items() if v["final_beyond_diff_ci"] and v["final_beyond_diff_ci"][0] > 0]
    if not out["vs"]:
        out["text"] = "No comparison: `none` is the only finished arm."
    elif out["above_ci"]:
        out["text"] = ("**Yes**: " + ", ".join(
            f"`{a}` (+{out['vs'][a]['final_beyond_diff']:.3f}, 95% CI [{out['vs'][a]['final_beyond_diff_ci'][0]:.3f}, "
            f"{out['vs'][a]['final_beyond_diff_ci'][1]:.3f}])" for a in out["above_ci"])
            + " ends higher than `none` beyond the boundary, the paired interval over seeds above 0.")
    else:
        best = max(out["vs"], key=lambda a: out["vs"][a]["final_beyond_diff"])
        ci = out["vs"][best]["final_beyond_diff_ci"]
        out["text"] = (f"**No**: no arm's paired interval of final beyond-boundary success minus `none`'s lies above 0; "
                       f"the largest mean difference is `{best}`'s {out['vs'][best]['final_beyond_diff']:+.3f}"
                       + (f" (95% CI [{ci[0]:.3f}, {ci[1]:.3f}])." if ci else " (one seed: no interval)."))
    return out


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
        db, db_ci, paired = _paired(arms[a], L, "final_beyond")
        da, da_ci, _ = _paired(arms[a], L, "auc_beyond")
        de, de_ci, _ = _paired(arms[a], L, "final_easy")
        out["vs"][a] = {"final_beyond_diff": db, "final_beyond_diff_ci": db_ci, "auc_beyond_diff": da,
                        "auc_beyond_diff_ci": da_ci, "final_easy_diff": de, "final_easy_diff_ci": de_ci,
                        "paired_seeds": paired}
    vs = out["vs"]
    above = [a for a in others if vs[a]["final_beyond_diff_ci"] and vs[a]["final_beyond_diff_ci"][0] > 0]
    below = [a for a in others if vs[a]["final_beyond_diff_ci"] and vs[a]["final_beyond_diff_ci"][1] < 0]
    parts = []
    if above:
        parts.append("above `" + learned + "` (paired interval above 0): " + ", ".join(f"`{a}`" for a in above))
    if below:
        parts.append("below it (interval below 0): " + ", ".join(f"`{a}`" for a in below))
    rest = [a for a in others if a not in above and a not in below]
    if rest:
        parts.append("not told apart from it: " + ", ".join(f"`{a}`" for a in rest))
    out["text"] = (f"The same controller as `{learned}` over other action spaces ({arms[learned]['controller']}), "
                   "final success beyond the boundary: " + "; ".join(parts) + ".")
    return out


# ---------------------------------------------------------------------------- after a task-mix shift
def _paired_defined(A: dict, B: dict, field: str) -> tuple[float | None, list[float] | None, list]:
    """:func:`_paired` over the common seeds where both arms have ``field`` (steps_to_follow is null where a
    controller never settled)."""
    seeds = [s for s in A["seeds"] if s in B["seeds"] and A["per_seed"][str(s)].get(field) is not None
             and B["per_seed"][str(s)].get(field) is not None]
    d = [A["per_seed"][str(s)][field] - B["per_seed"][str(s)][field] for s in seeds]
    return _mean(d), (t_interval(d) if len(d) >= 2 else None), seeds


SHIFT_FIELDS = ("shift_final", "shift_auc", "steps_to_follow")


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
                m, ci, seeds = _paired_defined(arms[a], R, f)
                d[f"{f}_diff"], d[f"{f}_diff_ci"], d[f"{f}_paired_seeds"] = m, ci, seeds
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
                ci = d[f"{f}_diff_ci"]
                nd = 1 if f == "steps_to_follow" else 3
                part.append(f"{what} {d[f'{f}_diff']:+.{nd}f}"
                            + (f" (95% CI [{ci[0]:.{nd}f}, {ci[1]:.{nd}f}])" if ci else " (one seed: no interval)"))
            lines.append(f"`{learned}` − `{reference}`, paired over seeds: " + "; ".join(part) + ".")
    never = [a for a in rep["arms_order"] if arms[a].get("steps_to_follow_never")]
    if never:
        lines.append("Never settled within the tolerance by the end of the run (seeds): "
                     + ", ".join(f"`{a}` ({arms[a]['steps_to_follow_never']})" for a in never) + ".")
    out["text"] = " ".join(lines)
    return out


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
                   less_budget_than_all_beyond=None)
        return out
    L = arms[learned]
    for f in fixed:
        db, db_ci, paired = _paired(L, arms[f], "final_beyond")
        da, da_ci, _ = _paired(L, arms[f], "auc_beyond")
        out["vs"][f] = {"final_beyond_diff": db, "final_beyond_diff_ci": db_ci,
                        "auc_beyond_diff": da, "auc_beyond_diff_ci": da_ci, "paired_seeds": paired}
    vs = out["vs"]
    above = [f for f in fixed if (vs[f]["final_beyond_diff"] or 0.0) > 0]
    sig = [f for f in fixed if vs[f]["final_beyond_diff_ci"] and vs[f]["final_beyond_diff_ci"][0] > 0]
    below = [f for f in fixed if (vs[f]["final_beyond_diff"] or 0.0) < 0]
    out["beats_all_mean"] = len(above) == len(fixed)
    out["beats_all_ci"] = len(sig) == len(fixed)
    n = L["n_seeds"]
    best = max(fixed, key=lambda f: arms[f]["final_beyond"])
    one_task = (1.0 / rep["eval_tasks_beyond"]) if rep.get("eval_tasks_beyond") else None
    lines = []
    equal = "at equal budget" if rep["budget"]["equal"] else "(note: budget spent differs between arms, see the table)"
    if out["beats_all_ci"]:
        lines.append(f"**Yes**: `{learned}` ends with higher held-out success beyond the boundary than every fixed "
                     f"heuristic {equal}: {L['final_beyond']:.3f} vs at most {arms[best]['final_beyond']:.3f} "
                     f"(`{best}`), every paired 95% interval over {n} seeds above 0.")
    elif out["beats_all_mean"]:
        why = ("a single seed gives no interval" if n < 2 else
               "the paired 95% interval includes 0 against " + ", ".join(f"`{f}`" for f in fixed if f not in sig))
        lines.append(f"**Not shown**: `{learned}`'s mean final success beyond the boundary "
                     f"({L['final_beyond']:.3f}) is above every fixed heuristic's {equal} (best fixed: `{best}`, "
                     f"{arms[best]['final_beyond']:.3f}), but {why}.")
    else:
        lines.append(f"**No**: {equal}, `{learned}`'s final success beyond the boundary ({L['final_beyond']:.3f}) is "
                     + ("not above " if not below else "below ")
                     + ", ".join(f"`{f}` ({arms[f]['final_beyond']:.3f})" for f in fixed if f not in above) + ".")
    top = max(arms[a]["final_beyond"] for a in arms)
    if one_task is not None and top < 0.05:
        lines.append(f"Beyond-boundary success is near zero for every arm (highest {top:.3f}); one held-out task "
                     f"moves that rate by {one_task:.4f} ({rep['eval_tasks_beyond']} tasks per evaluation), so these "
                     "differences amount to a few tasks.")
    # budget to reach the none arm's final success, on the easy levels and beyond the boundary
    for which, field, target, flag in (
            ("easy-level", "budget_to_match_none", rep.get("none_final_easy"), "less_budget_than_all"),
            ("beyond-boundary", "budget_to_match_none_beyond", rep.get("none_final_beyond"),
             "less_budget_than_all_beyond")):
        out[flag] = None
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
                         f"({target:.3f}) at an evaluation" + (f" (the others: {theirs})." if theirs else "."))
        else:
            lines.append(f"`{learned}` first reached the `none` arm's final {which} success "
                         f"({target:.3f}) after {ln:.0f} budget units"
                         + (f"; the other fixed heuristics: {theirs}" + (", so it needed the least budget." if less else ".")
                            if theirs else "."))
    missing = [a for a in rep.get("arms_missing", []) if a not in arms]
    if missing:
        lines.append("Not compared (no finished run): " + ", ".join(f"`{a}`" for a in missing) + ".")
    out["text"] = " ".join(lines)
    return out


# ---------------------------------------------------------------------------- figures
def _by_operator(series: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-key series summed per operator (:func:`rail.adaptivity.operator`): the figures colour operators,
    whatever the temperature."""
    out: dict[str, np.ndarray] = {}
    for k, v in series.items():
        op = adaptivity.operator(k)
        out[op] = out.get(op, 0) + np.asarray(v, dtype=float)
    return out


def _colors(names: list[str]) -> dict[str, Any]:
    import matplotlib

    # distinct hues first (tab10, then Dark2, then Set3), never two shades of one hue side by side (the choice maps
    # show a share as lightness); no greys: the choice maps draw "no group of the cell" in grey
    cmaps = [matplotlib.colormaps[m] for m in ("tab10", "Dark2", "Set3")]
    palette = [c for cm in cmaps for c in (cm(i) for i in range(cm.N)) if max(c[:3]) - min(c[:3]) > 0.05]
    return {a: palette[i % len(palette)] for i, a in enumerate(names)}


def draw_figures(rep: dict, root: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    arms, order = rep["arms"], rep["arms_order"]
    col = _colors(order)
    written = []
    levels = rep.get("levels", {})
    n_seeds = max((arms[a]["n_seeds"] for a in order), default=0)

    # learning curves: beyond and easy held-out success against budget spent
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharex=True)
    for ax, k, title in ((axes[0], "beyond", f"beyond the boundary (levels {levels.get('beyond')})"),
                         (axes[1], "easy", f"easy levels {levels.get('easy')}")):
        for a in order:
            c = arms[a]["curve"]
            x = np.array(c["budget_spent"], dtype=float)
            y = np.array([np.nan if v is None else v for v in c[k]], dtype=float)
            ax.plot(x, y, marker="o", ms=3, lw=2 if a == "rail" else 1.3, color=col[a], label=a)
            ci = c[f"{k}_ci"]
            if arms[a]["n_seeds"] >= 2 and all(ci):
                ax.fill_between(x, [v[0] for v in ci], [v[1] for v in ci], color=col[a], alpha=0.12, lw=0)
        top = max([v for a in order for v in arms[a]["curve"][k] if v is not None]
                  + [iv[1] for a in order for iv in arms[a]["curve"][f"{k}_ci"] if iv] + [0.0])
        ax.set_ylim(-0.02, max(0.05, 1.1 * top))
        ax.set_title(f"held-out unguided success, {title}")
        ax.set_xlabel(f"budget spent ({_unit(rep)})")
        ax.set_ylabel("success (pass@1)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2, loc="best")
    band = "mean over seeds, 95% t-band" if n_seeds >= 2 else "one seed"
    fig.suptitle(f"ablation {rep.get('ablation')}: learning curves ({band})")
    fig.tight_layout()
    fig.savefig(root / "learning_curves.png", dpi=110)
    plt.close(fig)
    written.append("learning_curves.png")

    # final beyond success per arm with its interval
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(order) + 2), 4))
    means = [np.nan if arms[a]["final_beyond"] is None else arms[a]["final_beyond"] for a in order]
    cis = [arms[a]["final_beyond_ci"] or [m, m] for a, m in zip(order, means)]
    lo = [m - c[0] for m, c in zip(means, cis)]
    hi = [c[1] - m for m, c in zip(means, cis)]
    ax.bar(range(len(order)), means, yerr=[lo, hi], color=[col[a] for a in order], capsize=4)
    init = _mean(arms[a]["initial_beyond"] for a in order)
    if init is not None:
        ax.axhline(init, color="k", lw=1, ls="--", label=f"initial ({init:.3f})")
        ax.legend(fontsize=8)
    tops = [c[1] for c in cis if c[1] is not None and np.isfinite(c[1])]
    ax.set_ylim(0, max([0.05, *(1.15 * t for t in tops)]))
    ax.set_xticks(range(len(order)), order, rotation=30, ha="right")
    ax.set_ylabel("final success beyond the boundary")
    ax.set_title(f"final held-out success beyond the boundary ({band})")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(root / "final_beyond.png", dpi=110)
    plt.close(fig)
    written.append("final_beyond.png")

    # the controller's choices: intervention rollouts per step, stacked by how@where (temperatures summed: one
    # colour per operator, so the colours stay distinct; the tables keep every temperature apart)
    active = [a for a in order if arms[a]["_choices_series"]["by_key"]]
    per_arm = {a: _by_operator({k: v["rollouts"] for k, v in arms[a]["_choices_series"]["by_key"].items()})
               for a in active}
    use: dict[str, float] = {}  # the most used operators get the first, most distinct colours
    for ops in per_arm.values():
        for op, y in ops.items():
            use[op] = use.get(op, 0.0) + float(y.sum())
    kcol = _colors(sorted(use, key=lambda k: (-use[k], k)))
    keys = sorted(use)
    if active:
        ncols = min(3, len(active))
        nrows = math.ceil(len(active) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.4 * nrows), squeeze=False, sharey=True)
        for i, a in enumerate(active):
            ax = axes[i // ncols][i % ncols]
            ch = arms[a]["_choices_series"]
            x = np.array(ch["step"])
            w = max(1, len(x) // 15)
            per_op = per_arm[a]
            ks = [k for k in keys if k in per_op]
            ys = [_smooth(per_op[k], w) for k in ks]
            ax.stackplot(x, *ys, labels=ks, colors=[kcol[k] for k in ks], alpha=0.85)
            ax.set_title(a)
            ax.set_xlabel("training step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if i % ncols == 0:
                ax.set_ylabel("intervention rollouts / step")
            ax.grid(alpha=0.3)
        for j in range(len(active), nrows * ncols):
            axes[j // ncols][j % ncols].axis("off")
        handles = [plt.Rectangle((0, 0), 1, 1, color=kcol[k]) for k in keys]
        fig.legend(handles, keys, loc="lower center", ncol=min(5, len(keys)), fontsize=8)
        fig.suptitle("where and how the controllers intervened (how@where; mean over seeds, smoothed)")
        fig.tight_layout(rect=(0, 0.06 + 0.02 * math.ceil(len(keys) / 5), 1, 0.96))
    else:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, "no arm intervened", ha="center", va="center")
        ax.axis("off")
    fig.savefig(root / "choices.png", dpi=110)
    plt.close(fig)
    written.append("choices.png")

    # how many: rollouts per decision, and the share of each step's budget spent on interventions
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for a in order:
        ch = arms[a]["_choices_series"]
        x = np.array(ch["step"])
        if not len(x):
            continue
        w = max(1, len(x) // 15)
        if ch["by_key"]:
            dec = np.sum([v["decisions"] for v in ch["by_key"].values()], axis=0)
            rol = np.sum([v["rollouts"] for v in ch["by_key"].values()], axis=0)
            ratio = np.where(dec > 0, rol / np.maximum(dec, 1e-9), np.nan)
            axes[0].plot(x, ratio, marker=".", ls="-", lw=1.2, color=col[a], label=a)
        axes[1].plot(x, _smooth(np.array(ch["intervention_budget_share"]), w), lw=1.3, color=col[a], label=a)
    axes[0].set_title("how many: intervention rollouts per decision")
    axes[0].set_ylabel("rollouts / decision")
    axes[1].set_title("share of each step's budget spent on interventions")
    axes[1].set_ylabel("intervention budget share")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(root / "how_many.png", dpi=110)
    plt.close(fig)
    written.append("how_many.png")

    _draw_choices_by_level(rep, root, plt, kcol)
    written.append("choices_by_level.png")
    return written


def _draw_choices_by_level(rep: dict, root: Path, plt, kcol: dict) -> None:
    """Per intervening arm, a map of family/level cells (rows) against training steps (columns, in bins of about
    1/40 of the run): the colour of the how@where chosen most in the bin, as strong as the share of the cell's
    groups intervened (white: none; grey: no group of that cell trained in the bin); the shift step dashed."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    arms, order = rep["arms"], rep["arms_order"]
    active = [a for a in order if any(sum(c["intervened"]) > 0 for c in arms[a]["_cells_series"]["series"].values())]
    keys = sorted({adaptivity.operator(k) for a in active for c in arms[a]["_cells_series"]["series"].values()
                   for k in c["keys"]})
    fallback = _colors(keys)
    for k in keys:
        kcol.setdefault(k, fallback[k])
    shift = rep.get("shift")
    if not active:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, "no arm intervened" if any(arms[a]["_cells_series"]["series"] for a in order) else
                "no per family/level choices logged (choice/ metrics)", ha="center", va="center")
        ax.axis("off")
        fig.savefig(root / "choices_by_level.png", dpi=110)
        plt.close(fig)
        return
    ncols = min(2, len(active))
    nrows = math.ceil(len(active) / ncols)
    names = _cell_order(c for a in active for c in arms[a]["_cells_series"]["series"])  # the same rows for every arm
    n_cells = len(names)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, (1.2 + 0.32 * n_cells) * nrows + 0.8), squeeze=False)
    for i, a in enumerate(active):
        ax = axes[i // ncols][i % ncols]
        cs = arms[a]["_cells_series"]
        steps = np.array(cs["step"], dtype=float)
        w = max(1, math.ceil(len(steps) / 40))
        bins = [slice(j, min(j + w, len(steps))) for j in range(0, len(steps), w)]
        img = np.ones((len(names), len(bins), 3))
        for r, c in enumerate(names):
            ser = cs["series"].get(c)
            if ser is None:  # no group of this cell in this arm's runs
                img[r] = 0.85
                continue
            grp, itv = np.array(ser["groups"]), np.array(ser["intervened"])
            dec = _by_operator(ser["keys"])
            for j, b in enumerate(bins):
                g = grp[b].sum()
                if g <= 0:
                    img[r, j] = 0.85
                    continue
                tot = {k: v[b].sum() for k, v in dec.items()}
                top = max(tot, key=tot.get) if tot and max(tot.values()) > 0 else None
                share = min(1.0, itv[b].sum() / g)
                if top is not None and share > 0:
                    img[r, j] = (1 - share) * np.ones(3) + share * np.array(kcol[top][:3])
        x0 = steps[0] - 0.5 if len(steps) else 0
        x1 = steps[-1] + 0.5 if len(steps) else 1
        ax.imshow(img, aspect="auto", interpolation="nearest", extent=(x0, x1, len(names) - 0.5, -0.5))
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_title(a)
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if shift is not None:
            ax.axvline(shift["step"] - 0.5, color="k", ls="--", lw=1.2)
    for j in range(len(active), nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    handles = [Patch(color=kcol[k]) for k in keys] + [Patch(color=(0.85, 0.85, 0.85))]
    fig.legend(handles, keys + ["no group of the cell"], loc="lower center", ncol=min(5, len(keys) + 1), fontsize=8)
    fig.suptitle("what the controllers chose per family and level: colour = the how@where chosen most, strength = share "
                 "of the cell's groups intervened" + (f" (dashed: task-mix shift at step {shift['step']})" if shift else ""),
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.05 + 0.02 * math.ceil((len(keys) + 1) / 5), 1, 0.95))
    fig.savefig(root / "choices_by_level.png", dpi=110)
    plt.close(fig)


def _unit(rep: dict) -> str:
    return rep.get("budget", {}).get("unit") or "budget units"


# ---------------------------------------------------------------------------- markdown
def _f(v, nd: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not math.isfinite(v):
        return "–"
    return f"{v:.{nd}f}"


def format_markdown(rep: dict) -> str:
    arms, order = rep["arms"], rep["arms_order"]
    L = [f"# Ablation `{rep.get('ablation')}`", ""]
    if rep.get("description"):
        L += [rep["description"], ""]
    seeds = rep["seeds"]
    L += [f"Preset `{rep.get('preset')}`, seeds {seeds}, {len(order)} arms with results"
          + (f" (from `{rep['config_file']}`)" if rep.get("config_file") else "") + ". Every arm gets the same "
          "budget per step and, per seed, the same task streams; only controller and learner settings differ. "
          f"Levels: easy {rep['levels'].get('easy')}, beyond the boundary {rep['levels'].get('beyond')} "
          f"({rep.get('eval_tasks_beyond')} held-out tasks per evaluation beyond, {rep.get('eval_tasks_easy')} easy). "
          "Field definitions: docs/ablation.md.", ""]
    L += ["## Does `rail` beat the fixed heuristics beyond the boundary?", "", rep["verdict"]["text"], ""]
    vs = rep["verdict"].get("vs", {})
    if vs:
        L += [f"Paired differences `{rep['verdict']['learned']}` − arm over seeds (95% t-interval with ≥ 2 seeds):", "",
              "| arm | Δ final beyond | 95% CI | Δ AUC beyond | 95% CI | seeds |", "|---|---|---|---|---|---|"]
        for f in [a for a in rep["arms_order"] if a in vs]:  # report order, also when read back from report.json
            d = vs[f]
            L.append(f"| `{f}` | {_f(d['final_beyond_diff'])} | {_ci(d['final_beyond_diff_ci'])} | "
                     f"{_f(d['auc_beyond_diff'])} | {_ci(d['auc_beyond_diff_ci'])} | {len(d['paired_seeds'])} |")
        L.append("")
    vn = rep.get("versus_none")
    if vn:
        L += ["## Does any arm end higher than plain GRPO (`none`) beyond the boundary?", "", vn["text"], ""]
        if vn["vs"]:
            L += ["Paired differences arm − `none` over seeds (95% t-interval with ≥ 2 seeds):", "",
                  "| arm | Δ final beyond | 95% CI | Δ final easy | 95% CI | seeds |", "|---|---|---|---|---|---|"]
            for a in [a for a in rep["arms_order"] if a in vn["vs"]]:
                d = vn["vs"][a]
                L.append(f"| `{a}` | {_f(d['final_beyond_diff'])} | {_ci(d['final_beyond_diff_ci'])} | "
                         f"{_f(d['final_easy_diff'])} | {_ci(d['final_easy_diff_ci'])} | {len(d['paired_seeds'])} |")
            L.append("")
    vl = rep.get("versus_learned")
    if vl:
        L += ["## The learned controller over other action spaces", "", vl["text"], "",
              f"Paired differences arm − `{vl['learned']}` over seeds (95% t-interval with ≥ 2 seeds):", "",
              "| arm | Δ final beyond | 95% CI | Δ AUC beyond | 95% CI | Δ final easy | 95% CI | seeds |",
              "|---|---|---|---|---|---|---|---|"]
        for a in [a for a in rep["arms_order"] if a in vl["vs"]]:
            d = vl["vs"][a]
            L.append(f"| `{a}` | {_f(d['final_beyond_diff'])} | {_ci(d['final_beyond_diff_ci'])} | "
                     f"{_f(d['auc_beyond_diff'])} | {_ci(d['auc_beyond_diff_ci'])} | "
                     f"{_f(d['final_easy_diff'])} | {_ci(d['final_easy_diff_ci'])} | {len(d['paired_seeds'])} |")
        L.append("")
    L += ["## Results per arm (means over seeds)", "",
          "| arm | controller | seeds | final easy | final beyond | 95% CI | AUC beyond | budget to match none (easy) "
          "| budget to match none (beyond) | zero-var share | acceptance | interv. share | rollouts/decision | wall s "
          "| ctl overhead |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in order:
        v = arms[a]
        ci = v["final_beyond_ci"] or [float("nan")] * 2
        match = "never" if v["budget_to_match_none"] is None else f"{v['budget_to_match_none']:.0f}"
        beyond = v.get("budget_to_match_none_beyond")
        match_b = "never" if beyond is None else f"{beyond:.0f}"
        L.append(f"| `{a}` | {v['controller']} | {v['n_seeds']} | {_f(v['final_easy'])} | {_f(v['final_beyond'])} | "
                 f"[{ci[0]:.3f}, {ci[1]:.3f}] | {_f(v['auc_beyond'])} | {match} | {match_b} | "
                 f"{_f(v['zero_variance_share'])} | {_f(v['acceptance'])} | {_f(v['intervention_budget_share'])} | "
                 f"{_f(v['rollouts_per_decision'], 2)} | {_f(v['wall_seconds'], 0)} | {_f(v['controller_overhead'], 4)} |")
    b = rep["budget"]
    spent = sorted({round(x) for x in b["per_arm"].values() if x is not None})
    L += ["", f"Budget spent per run: {', '.join(map(str, spent))} "
              f"({'the same for every arm' if b['equal'] else 'NOT the same for every arm'}). "
              + (f"`none`'s final easy success, the target of 'budget to match none (easy)': {rep['none_final_easy']:.3f}"
                 + (f"; its final success beyond the boundary, the target of 'budget to match none (beyond)': "
                    f"{rep['none_final_beyond']:.3f}." if _finite(rep.get("none_final_beyond")) else ".")
                 if rep.get("none_final_easy") is not None else "No `none` arm: 'budget to match none' is empty."), ""]
    cells = list(dict.fromkeys(c for a in order for c in arms[a].get("final_beyond_cells", {})))
    if cells:
        L += ["## Final success beyond the boundary per family and level (means over seeds)", "",
              "Where a difference comes from: each level beyond the boundary on its own (per-seed values in "
              "report.json)" + (", with the paired mean difference from `none`" if "none" in arms else "") + ".", "",
              "| arm | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
        for a in order:
            v = arms[a].get("final_beyond_cells", {})
            row = []
            for c in cells:
                x = v.get(c)
                d = None
                if "none" in arms and a != "none" and x is not None:
                    common = [sd for sd in arms[a]["seeds"] if sd in arms["none"]["seeds"]]
                    diffs = [arms[a]["per_seed"][str(sd)].get("final_beyond_cells", {}).get(c, float("nan"))
                             - arms["none"]["per_seed"][str(sd)].get("final_beyond_cells", {}).get(c, float("nan"))
                             for sd in common]
                    d = _mean(diffs) if diffs else None
                row.append(_f(x, 2) + (f" ({d:+.2f})" if d is not None and np.isfinite(d) else ""))
            L.append(f"| `{a}` | " + " | ".join(row) + " |")
        L.append("")
    L += ["## What the controllers chose", "", "| arm | how@where: decisions (rollouts), summed over training, mean over seeds |",
          "|---|---|"]
    for a in order:
        ch = arms[a]["choices"]
        if ch:
            L.append(f"| `{a}` | " + ", ".join(f"{k}: {c['decisions']:.0f} ({c['rollouts']:.0f})"
                                              for k, c in sorted(ch.items(), key=lambda kv: -kv[1]['rollouts'])) + " |")
        else:
            L.append(f"| `{a}` | no interventions |")
    L.append("")
    L += _markdown_by_cell(rep)
    L += _markdown_shift(rep)
    if rep["failed"]:
        L += ["## Failed jobs", "", "| job | status | exit code | last stderr lines |", "|---|---|---|---|"]
        for f in rep["failed"]:
            tail = "<br>".join(_md_escape(x) for x in (f["stderr_tail"] or [f.get("error") or ""])[-5:])
            L.append(f"| `{f['job']}` | {f['status']} | {f['returncode']} | {tail} |")
        L.append("")
    L += ["## Figures", ""]
    for name, what in (("learning_curves.png", "held-out success against budget spent"),
                       ("final_beyond.png", "final success beyond the boundary per arm"),
                       ("choices.png", "intervention rollouts per step by how@where"),
                       ("how_many.png", "rollouts per decision and intervention budget share per step"),
                       ("choices_by_level.png", "share of groups intervened and the operator chosen most, per family "
                                                "and level over training")):
        if name in rep.get("figures", []):
            L += [f"![{what}]({name})", ""]
    return "\n".join(L)


def _cell_order(labels) -> list[str]:
    """Distinct ``"<family> L<level>"`` labels by family, then level."""
    def key(c: str):
        fam, _, lv = c.rpartition(" L")
        return fam, int(lv) if lv.isdigit() else 0
    return sorted(set(labels), key=key)


def _markdown_by_cell(rep: dict) -> list[str]:
    arms, order = rep["arms"], rep["arms_order"]
    cells = _cell_order(c for a in order for c in arms[a].get("choices_by_cell", {}))
    if not cells:
        return []
    L = ["## What the controllers chose per family and level", "",
         "Share of the cell's groups intervened over training (pooled over steps and seeds) and the how@where chosen "
         "most there; over time in `choices_by_level.png`.", "",
         "| arm | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
    for a in order:
        by = arms[a].get("choices_by_cell", {})
        row = []
        for c in cells:
            v = by.get(c)
            if not v or v["intervened_share"] is None:
                row.append("–")
            else:
                row.append(f"{v['intervened_share']:.2f}" + (f" {v['dominant']}" if v["dominant"] else ""))
        L.append(f"| `{a}` | " + " | ".join(row) + " |")
    return L + [""]


def _markdown_shift(rep: dict) -> list[str]:
    sh, arms, order = rep.get("shift"), rep["arms"], rep["arms_order"]
    if sh is None:
        return []
    adv = rep.get("after_shift") or {}
    L = [f"## After the task-mix shift at step {sh['step']}", "", adv.get("text", ""), "",
         f"Steps to follow: steps after the shift until the controller's choice distribution on the new mix stays "
         f"within {sh['tolerance']} (total variation) of its own steady state ({sh['steady_state']}), each step's "
         f"distribution pooled over {sh['window']}; mean over the seeds that settled, \"never\" counting the others "
         "(docs/metrics.md, Adaptivity).", ""]
    ref = adv.get("reference")
    head = "| arm | steps to follow | never (seeds) | success at the shift | final on the mix | 95% CI | AUC after | 95% CI |"
    if ref:
        head += f" Δ final − `{ref}` | 95% CI | Δ AUC − `{ref}` | 95% CI | Δ steps − `{ref}` | 95% CI |"
    L += [head, "|" + "---|" * (head.count("|") - 1)]
    for a in order:
        v = arms[a]
        row = (f"| `{a}` | {_f(v['steps_to_follow'], 1)} | {v['steps_to_follow_never']} | {_f(v['shift_initial'])} | "
               f"{_f(v['shift_final'])} | {_ci(v['shift_final_ci'])} | {_f(v['shift_auc'])} | {_ci(v['shift_auc_ci'])} |")
        if ref:
            d = adv["vs"].get(a)
            if d is None:
                row += " – | – | – | – | – | – |"
            else:
                row += "".join(f" {_f(d[f'{f}_diff'], 1 if f == 'steps_to_follow' else 3)} | {_ci(d[f'{f}_diff_ci'])} |"
                               for f in SHIFT_FIELDS)
        L.append(row)
    return L + [""]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("<", "&lt;")


# ---------------------------------------------------------------------------- entry points
def write_report(root: Path, parent=None, figures: bool = True) -> dict:
    """Write report.md, report.json and the figures into ``root``; log them to the parent run if any."""
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
    rep["after_shift"] = after_shift(rep)
    rep["figures"] = draw_figures(rep, root) if figures else []
    public = json.loads(json.dumps(rep, default=float))
    for a in public["arms"].values():
        a.pop("_choices_series", None)
        a.pop("_cells_series", None)
    write_text_atomic(root / "report.json", json.dumps(public, indent=1, sort_keys=True))
    write_text_atomic(root / "report.md", format_markdown(rep))
    _log_to_parent(root, state, public, parent)
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
