"""Quartiles of a set of ratios (per-prompt speedups, per-request paired ratios): how far one sits from another."""

from __future__ import annotations

import statistics


def quartiles(values: list[float]) -> dict[str, float]:
    """p25, p50, p75 (linear interpolation between order statistics, as numpy's and torch's default), min, max."""
    if not values:
        raise ValueError("quartiles of no values")
    ordered = sorted(values)
    if len(ordered) == 1:
        q = [ordered[0]] * 3
    else:
        q = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"p25": q[0], "p50": q[1], "p75": q[2], "min": ordered[0], "max": ordered[-1]}
