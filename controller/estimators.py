"""Off-policy estimators over logged bandit events, with normal-approximation confidence intervals.

Each logged event ``i`` has the logging policy's probability ``p_i`` of the action it took, the reward
``r_i``, a target policy's probability ``pi_i`` of that action, and (for doubly robust) the reward model's
predictions ``q_i[a]`` and the target's full PMF ``pi_full_i[a]``. With ``w_i = pi_i / p_i``:

* IPS:   V = mean(w_i r_i)
* SNIPS: V = sum(w_i r_i) / sum(w_i)
* DR:    V = mean( sum_a pi_full_i[a] q_i[a] + w_i (r_i - q_i[a_i]) )

``difference`` estimates V(target) - V(baseline) event by event with the DR form, which is what the
go-live gate bounds. Intervals are mean +- z * sd / sqrt(n) of the per-event terms (SNIPS: the delta
method); one-sided bounds use ``z`` for the given ``alpha``.
"""

from __future__ import annotations

import math
from operator import mul
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence


@dataclass(frozen=True)
class Estimate:
    value: float
    lower: float
    upper: float
    n: int

    def to_dict(self) -> dict:
        return {"value": self.value, "lower": self.lower, "upper": self.upper, "n": self.n}


def _z(alpha: float, two_sided: bool = True) -> float:
    return NormalDist().inv_cdf(1 - alpha / 2 if two_sided else 1 - alpha)


def mean_ci(terms: Sequence[float], alpha: float, two_sided: bool = True) -> Estimate:
    """The mean of per-event terms with a normal-approximation interval (one-sided bounds: ``two_sided=False``)."""
    n = len(terms)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    m = sum(terms) / n
    if n < 2:
        return Estimate(m, float("-inf"), float("inf"), n)
    sd = math.sqrt(sum((t - m) ** 2 for t in terms) / (n - 1))
    h = _z(alpha, two_sided) * sd / math.sqrt(n)
    return Estimate(m, m - h, m + h, n)


def _check(p: Sequence[float]) -> None:
    for x in p:
        if not (0.0 < x <= 1.0):
            raise ValueError(f"logged propensity {x!r} outside (0, 1]: an event with p = 0 cannot be evaluated")


def ips(r: Sequence[float], p: Sequence[float], pi: Sequence[float], alpha: float = 0.05) -> Estimate:
    _check(p)
    return mean_ci([ri * qi / pi_ for ri, pi_, qi in zip(r, p, pi)], alpha)


def snips_value(w: Sequence[float], r: Sequence[float]) -> float:
    """The SNIPS value from the importance weights ``w_i = pi_i / p_i``: sum(w_i r_i) / sum(w_i)."""
    sw = sum(w)
    if not w or sw <= 0:
        return float("nan")
    return sum(map(mul, w, r)) / sw


def snips(r: Sequence[float], p: Sequence[float], pi: Sequence[float], alpha: float = 0.05) -> Estimate:
    _check(p)
    w = [qi / pi_ for pi_, qi in zip(p, pi)]
    n, sw = len(w), sum(w)
    if n == 0 or sw <= 0:
        return Estimate(float("nan"), float("nan"), float("nan"), n)
    v = snips_value(w, r)
    if n < 2:
        return Estimate(v, float("-inf"), float("inf"), n)
    mw = sw / n
    var = sum((wi * (ri - v)) ** 2 for wi, ri in zip(w, r)) / (n - 1) / (mw * mw)  # delta method
    h = _z(alpha) * math.sqrt(var / n)
    return Estimate(v, v - h, v + h, n)


def dr_term(r: float, p: float, chosen: int, pi_full: Sequence[float], q: Sequence[float]) -> float:
    """One event's doubly-robust term for a target PMF ``pi_full``: the reward model's expected value under the
    target plus the importance-weighted residual of the logged action."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"logged propensity {p!r} outside (0, 1]: an event with p = 0 cannot be evaluated")
    dm = sum(map(mul, pi_full, q))  # the same products, summed in the same order, as a generator would
    return dm + pi_full[chosen] / p * (r - q[chosen])


def dr_terms(r, p, chosen, pi_full, q) -> list[float]:
    """Per-event doubly-robust terms for a target PMF ``pi_full`` (rows of per-action probabilities)."""
    return [dr_term(*ev) for ev in zip(r, p, chosen, pi_full, q)]


def dr(r, p, chosen, pi_full, q, alpha: float = 0.05) -> Estimate:
    return mean_ci(dr_terms(r, p, chosen, pi_full, q), alpha)


def difference(r, p, chosen, target, baseline, q, alpha: float = 0.05) -> Estimate:
    """DR estimate of V(target) - V(baseline), with a one-sided (1 - alpha) lower and upper bound."""
    t = dr_terms(r, p, chosen, target, q)
    b = dr_terms(r, p, chosen, baseline, q)
    return mean_ci([x - y for x, y in zip(t, b)], alpha, two_sided=False)
