"""What the parts of ``rail report`` share: statistics over seeds, the order of cells, and the fields the
comparison after a task-mix shift pairs."""

from __future__ import annotations

import math

import numpy as np

SHIFT_FIELDS = ("shift_final", "shift_auc", "steps_to_follow")


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


def mean(values) -> float | None:
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def smooth(y: np.ndarray, w: int) -> np.ndarray:
    if w <= 1 or len(y) < w:
        return y
    k = np.ones(w) / w
    pad = np.concatenate([np.full(w // 2, y[0]), y, np.full(w - 1 - w // 2, y[-1])])
    return np.convolve(pad, k, mode="valid")


def ci_text(ci) -> str:
    return "–" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def cell_order(labels) -> list[str]:
    """Distinct ``"<family> L<level>"`` labels by family, then level."""
    def key(c: str):
        fam, _, lv = c.rpartition(" L")
        return fam, int(lv) if lv.isdigit() else 0
    return sorted(set(labels), key=key)
