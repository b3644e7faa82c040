"""Per-request ratios between two arms of an interleaved `bench serve`: in each pass both arms send request i
with the same prompt and seed, one turn apart, so request i's TPS/user under one arm over the other's is a ratio
that slow drift of a shared machine barely moves (a level's median under one arm over the other's median is
moved by it: the arms' turns are minutes apart by the last pass)."""

from __future__ import annotations

from typing import Any

from dspark.bench.load import LevelResult, tps_user_of
from dspark.bench.quartiles import quartiles


def paired_tps_user_ratios(arm: list[LevelResult], ref: list[LevelResult]) -> list[float]:
    """arm's TPS/user over ref's, request by request, pass by pass (requests that failed in either are left out)."""
    if len(arm) != len(ref):
        raise ValueError(f"paired passes: {len(arm)} against {len(ref)}")
    ratios = []
    for a, b in zip(arm, ref):
        for ra, rb in zip(a.records, b.records):
            x, y = tps_user_of(ra), tps_user_of(rb)
            if x is not None and y:
                ratios.append(x / y)
    return ratios


def paired_summary(arm: list[LevelResult], ref: list[LevelResult]) -> dict[str, Any] | None:
    """Quartiles of the paired ratios and how many pairs; None where no request succeeded under both arms."""
    ratios = paired_tps_user_ratios(arm, ref)
    return {**quartiles(ratios), "num_pairs": len(ratios)} if ratios else None
