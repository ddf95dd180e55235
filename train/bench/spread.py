"""Repeated rounds of interleaved timing, their median and range, and the verdict a range gives against a goal.

One run of a step on one machine moves by several percent; a goal set a few percent away cannot be decided by
it. Every speed row of `python -m train.bench.gpu` therefore times its interleaved calls in ROUNDS rounds (each a
median over its repeats) and keeps every round. A goal is met only when the whole range meets it, missed only when
the whole range misses it, and undecided when the range straddles it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from train.bench.timing import interleaved_medians

ROUNDS = 3  # the fewest rounds a goal is decided on
VERDICTS = ("met", "missed", "undecided", "not measured")


def interleaved_rounds(fns: dict[str, Callable[[], None]], rounds: int, repeats: int, warmup: int, device="cpu",
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each function in each of `rounds` rounds (the warm-up only before the first): each round
    is train.bench.timing.interleaved_medians, so the calls alternate within a round as they always did."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds):
        for name, seconds in interleaved_medians(fns, repeats, warmup if i == 0 else 0, device, clock=clock).items():
            out[name].append(seconds)
    return out


def spread(values: Sequence[float | None]) -> dict:
    """{"median", "low", "high", "n"} of the values given (None where there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "low": None, "high": None, "n": 0}
    return {"median": statistics.median(values), "low": min(values), "high": max(values), "n": len(values)}


def verdict(low: float | None, high: float | None, bound: float, at_most: bool = False) -> str:
    """met when the whole range [low, high] meets the goal (>= bound, or <= bound with at_most), missed when the
    whole range misses it, undecided when it straddles the bound; "not measured" without a range."""
    if low is None or high is None:
        return "not measured"
    meets = (lambda v: v <= bound) if at_most else (lambda v: v >= bound)
    if meets(low) and meets(high):
        return "met"
    if not meets(low) and not meets(high):
        return "missed"
    return "undecided"


def ratio_range(top: Sequence[float], bottom: Sequence[float]) -> dict:
    """Median and range of top / bottom where the two were measured apart (a trainer's rate against the bare step's):
    the range pairs the extremes, min(top) / max(bottom) to max(top) / min(bottom), so it holds every pairing."""
    t, b = spread(top), spread(bottom)
    if t["n"] == 0 or b["n"] == 0:
        return spread([])
    return {"median": t["median"] / b["median"], "low": t["low"] / b["high"], "high": t["high"] / b["low"], "n": min(t["n"], b["n"])}
