"""Seed statistics of the table: mean, sample std, 95% t-intervals, and routed-minus-unrouted differences.

With 2-5 seeds a normal interval (1.96 std / sqrt(n)) is far too narrow; Student's t with n - 1 degrees of
freedom is the honest width. Differences use Welch's interval (unequal variances, Welch-Satterthwaite
degrees of freedom), because a routed cell and its baseline need not share a spread.
"""

from __future__ import annotations

import math
import statistics

from scipy import stats as scipy_stats


def summary(values: list[float]) -> dict[str, float | int | None]:
    """Mean, sample std and the half-width of the 95% t-interval of the mean (None below two values)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "ci95": None, "n": 0}
    if len(values) == 1:
        return {"mean": values[0], "std": None, "ci95": None, "n": 1}
    std = statistics.stdev(values)
    return {"mean": statistics.fmean(values), "std": std, "n": len(values),
            "ci95": scipy_stats.t.ppf(0.975, len(values) - 1) * std / math.sqrt(len(values))}


def welch_difference(a: list[float], b: list[float]) -> dict[str, float | None]:
    """mean(a) - mean(b) and its 95% Welch interval (None when either side has fewer than two values)."""
    a, b = [v for v in a if v is not None], [v for v in b if v is not None]
    if not a or not b:
        return {"diff": None, "low": None, "high": None}
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return {"diff": diff, "low": None, "high": None}
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return {"diff": diff, "low": diff, "high": diff}
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))  # Welch-Satterthwaite
    half = scipy_stats.t.ppf(0.975, dof) * se
    return {"diff": diff, "low": diff - half, "high": diff + half}


def verdict(difference: dict, lower_is_better: bool) -> str:
    """'wins' / 'loses' when the 95% interval of routed - unrouted excludes 0, else 'ties (within spread)'."""
    low, high = difference["low"], difference["high"]
    if low is None or high is None:
        return "n/a (one seed)"
    if low <= 0 <= high:
        return "ties"
    better = high < 0 if lower_is_better else low > 0
    return "wins" if better else "loses"
