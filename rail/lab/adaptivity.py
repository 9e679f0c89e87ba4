"""Adaptivity: what a controller chooses per family and level over training, and, in a run whose training task mix
changes mid-run (``env.shift_step``), how fast its choices settle after the change and how the policy does on the
new mix. Read from a run's ``metrics.jsonl`` rows (``choice/<family>/level_<L>/…``), its ``config.json`` and its
evaluation history; every quantity is defined in docs/metrics.md ("Adaptivity") and used by ``rail report``.

Torch-free: numpy only.
"""

from __future__ import annotations

import math
import re

import numpy as np

#: steps_to_follow: the largest total-variation distance from the post-shift steady state that counts as followed
TOLERANCE = 0.25
#: the category of the choice distribution that counts a group left without intervention
NONE = "none"

#: an intervention's key in metric names: how@where, or how@where:T at a temperature of its own
KEY = r"[a-z_]+@[a-z]+(?::[0-9.]+)?"


def operator(key: str) -> str:
    """``how@where`` of a key ``how@where[:T]``: the operator, whatever the temperature."""
    return key.split(":", 1)[0]
CHOICE = re.compile(rf"^choice/(.+)/level_(\d+)/(groups|intervened|{KEY})$")


def cell_label(family: str, level: int | str) -> str:
    return f"{family} L{int(level)}"


def cell_series(rows: list[dict]) -> dict[str, dict]:
    """Per cell ``"<family> L<level>"`` (sorted by family, then level): ``family``, ``level``, and per training step
    (aligned with ``rows``) ``groups``, ``intervened`` and ``keys`` {how@where: decisions}; 0 where a step logged
    nothing for it. Empty for runs that logged no ``choice/`` metrics."""
    found: dict[tuple[str, int], dict] = {}
    n = len(rows)
    for i, r in enumerate(rows):
        for name, v in r.items():
            m = CHOICE.match(name)
            if not m or v is None:
                continue
            fam, lv, what = m.group(1), int(m.group(2)), m.group(3)
            c = found.setdefault((fam, lv), {"family": fam, "level": lv, "groups": [0.0] * n,
                                             "intervened": [0.0] * n, "keys": {}})
            series = c[what] if what in ("groups", "intervened") else c["keys"].setdefault(what, [0.0] * n)
            series[i] = float(v)
    return {cell_label(f, lv): found[(f, lv)] for f, lv in sorted(found)}


def shift_of(config: dict) -> dict | None:
    """A run's task-mix shift from its ``config.json``: ``step`` and the ``families`` and ``levels`` trained from
    it on (the empty lists resolved to ``env.families`` / ``env.levels``); None without a shift."""
    env = config.get("env", {}) or {}
    step = int(env.get("shift_step") or 0)
    if step <= 0:
        return None
    return {"step": step, "families": list(env.get("shift_families") or env.get("families") or []),
            "levels": [int(x) for x in (env.get("shift_levels") or env.get("levels") or [])]}


def _in_mix(family: str, level: int, shift: dict) -> bool:
    fam_ok = any(family == f or family.startswith(f + "/") for f in shift["families"])  # bfcl/<category> rows
    return fam_ok and int(level) in shift["levels"]


def choice_counts(cells: dict[str, dict], steps: list[int], shift: dict) -> list[dict[str, float]]:
    """Per training step from ``shift["step"]`` on: the controller's choices on the groups of the shifted mix, as
    counts per category: each intervention counts once under its how@where, each group left without intervention
    once under ``"none"``."""
    out = []
    for i, st in enumerate(steps):
        if st < shift["step"]:
            continue
        c: dict[str, float] = {}
        for cell in cells.values():
            if not _in_mix(cell["family"], cell["level"], shift):
                continue
            c[NONE] = c.get(NONE, 0.0) + cell["groups"][i] - cell["intervened"][i]
            for k, series in cell["keys"].items():
                c[k] = c.get(k, 0.0) + series[i]
        out.append(c)
    return out


def _pooled(counts: list[dict[str, float]]) -> dict[str, float]:
    tot: dict[str, float] = {}
    for c in counts:
        for k, v in c.items():
            tot[k] = tot.get(k, 0.0) + v
    return tot


def _distance(a: dict[str, float], b: dict[str, float]) -> float | None:
    """Total-variation distance between the normalised counts ``a`` and ``b`` (None when either is empty)."""
    sa, sb = sum(a.values()), sum(b.values())
    if sa <= 0 or sb <= 0:
        return None
    return 0.5 * sum(abs(a.get(k, 0.0) / sa - b.get(k, 0.0) / sb) for k in set(a) | set(b))


def follow_window(n: int) -> int:
    """Post-shift steps pooled into each step's choice distribution: a fifth of them, at least 1 (a step's 16-30
    groups alone give distances of 0.15-0.3 between two steps of the same choices)."""
    return max(1, math.ceil(n / 5))


def steady_steps(n: int) -> int:
    """Post-shift steps whose pooled choices are the steady state: the last quarter, at least 1."""
    return max(1, math.ceil(n / 4))


def follow_distances(counts: list[dict[str, float]], window: int | None = None) -> list[float | None]:
    """Per post-shift step t: the total-variation distance between the choices pooled over the trailing ``window``
    post-shift steps ending at t and the steady state (the last quarter's pooled choices)."""
    n = len(counts)
    if not n:
        return []
    w = window or follow_window(n)
    steady = _pooled(counts[n - steady_steps(n):])
    return [_distance(_pooled(counts[max(0, t - w + 1): t + 1]), steady) for t in range(n)]


def steps_to_follow(counts: list[dict[str, float]], tol: float = TOLERANCE, window: int | None = None) -> int | None:
    """The fewest steps k >= 0 after the shift from which on every post-shift step's choice distribution is within
    ``tol`` (total variation) of the steady state (:func:`follow_distances`; a step whose window holds no group is
    passed over); None when the last one is not, or when no choice was logged after the shift."""
    d = follow_distances(counts, window)
    if not d or all(x is None for x in d):
        return None
    k = len(d)
    for t in range(len(d) - 1, -1, -1):
        if d[t] is not None and d[t] > tol:
            break
        k = t
    return k if k < len(d) else None


def shift_success(history: list[dict], shift: dict) -> dict:
    """Held-out success on the shifted mix (the evaluated cells of its families and levels) around the shift, from
    ``eval.history``: ``cells``; ``start_step``, the last evaluation before the shift step (the policy the shift
    met); ``initial``, its success there; ``final``, at the last evaluation; ``auc``, the trapezoid over the
    evaluations from ``start_step`` to the last (x = budget spent) divided by the budget between them, i.e. the
    mean success on the new mix over the budget spent after the change. None where no cell of the mix was
    evaluated."""
    hist = sorted(history, key=lambda h: h["step"])
    cells = sorted({cell_label(fam, lv) for h in hist for fam, rates in h["success"].items() for lv in rates
                    if _in_mix(fam, int(lv), shift)})
    out = {"cells": cells, "start_step": None, "initial": None, "final": None, "auc": None}
    before = [h for h in hist if h["step"] < shift["step"]]
    if not cells or not before:
        return out

    def mix(h: dict) -> float | None:
        v = [float(r) for fam, rates in h["success"].items() for lv, r in rates.items() if _in_mix(fam, int(lv), shift)]
        return float(np.mean(v)) if v else None

    span = [before[-1], *[h for h in hist if h["step"] >= shift["step"]]]
    y = [mix(h) for h in span]
    x = [float(h["budget_spent"]) for h in span]
    out.update(start_step=span[0]["step"], initial=y[0], final=y[-1])
    if any(v is None for v in y):
        return out
    width = x[-1] - x[0]
    if len(x) >= 2 and width > 0:
        out["auc"] = float(sum((y[i] + y[i + 1]) / 2 * (x[i + 1] - x[i]) for i in range(len(x) - 1)) / width)
    else:
        out["auc"] = y[-1]
    return out
