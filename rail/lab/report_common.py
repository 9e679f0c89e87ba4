"""What the parts of ``rail report`` share: statistics over seeds, the order of cells, and the fields the
comparison after a task-mix shift pairs."""

from __future__ import annotations

import math

import numpy as np

SHIFT_FIELDS = ("shift_final", "shift_auc", "steps_to_follow")


#: Intervals over fewer seeds than this are marked (``†`` in report.md, ``few_seeds`` in report.json).
MIN_SEEDS = 3
#: Where a rate's mean lies, and a paired difference of two rates.
RATE = (0.0, 1.0)
RATE_DIFF = (-1.0, 1.0)
FEW_SEEDS_NOTE = "† fewer than 3 seeds: interval unreliable."


def t_interval(values, alpha: float = 0.05, bounds: tuple[float, float] | None = None) -> list[float] | None:
    """Two-sided (1 - alpha) t-interval of the mean over seeds, clipped to ``bounds`` (:data:`RATE` for a rate,
    :data:`RATE_DIFF` for a paired difference of rates); None under 2 values (one seed gives no interval)."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if len(v) < 2:
        return None
    from scipy import stats

    m = float(np.mean(v))
    half = float(stats.t.ppf(1 - alpha / 2, len(v) - 1) * np.std(v, ddof=1) / math.sqrt(len(v)))
    lo, hi = m - half, m + half
    if bounds is not None:
        lo, hi = min(max(lo, bounds[0]), bounds[1]), min(max(hi, bounds[0]), bounds[1])
    return [lo, hi]


def n_defined(values) -> int:
    """How many of ``values`` an interval or mean is computed from (the finite ones)."""
    return sum(1 for x in values if x is not None and math.isfinite(x))


def few_seeds(n: int | None) -> bool:
    return n is not None and 0 < n < MIN_SEEDS


def mean(values) -> float | None:
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def smooth(y: np.ndarray, w: int) -> np.ndarray:
    if w <= 1 or len(y) < w:
        return y
    k = np.ones(w) / w
    pad = np.concatenate([np.full(w // 2, y[0]), y, np.full(w - 1 - w // 2, y[-1])])
    return np.convolve(pad, k, mode="valid")


def ci_text(ci, n: int | None = None, nd: int = 3, signed: bool = False) -> str:
    """An interval for report.md: ``[lo, hi]``, marked ``†`` when it comes from fewer than :data:`MIN_SEEDS`
    seeds; ``n=1`` for one seed (no interval); ``–`` for none."""
    if n == 1:
        return "n=1"
    if not ci:
        return "–"
    f = f"{{:+.{nd}f}}" if signed else f"{{:.{nd}f}}"
    return f"[{f.format(ci[0])}, {f.format(ci[1])}]" + ("†" if few_seeds(n) else "")


def missing_text(rep: dict) -> str:
    """``Missing: k of N jobs — `arm` seeds 1, 2 running; ...``: the planned jobs without summary.json."""
    by_arm: dict[str, dict[str, list[int]]] = {}
    for m in rep["missing"]:
        by_arm.setdefault(m["arm"], {}).setdefault(m["state"], []).append(m["seed"])
    parts = []
    for arm, states in by_arm.items():
        parts.append(f"`{arm}` " + ", ".join(
            f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} {st}" for st, seeds in states.items()))
    return f"Missing: {len(rep['missing'])} of {rep['jobs_planned']} jobs — " + "; ".join(parts)


def cell_order(labels) -> list[str]:
    """Distinct ``"<family> L<level>"`` labels by family, then level."""
    def key(c: str):
        fam, _, lv = c.rpartition(" L")
        return fam, int(lv) if lv.isdigit() else 0
    return sorted(set(labels), key=key)
