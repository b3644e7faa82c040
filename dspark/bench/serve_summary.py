"""`dspark bench serve`'s summary: per arm the throughput against the no-spec arm, the TPS/user against MTP-1's at
matched throughput, the trend of the verification length with concurrency (Spearman), and the flags a reader
should look at."""

from __future__ import annotations

import bisect
from typing import Any

APP_NAME = "dspark-bench"
PEER_ARM = "peer"
BUILTIN_ARM_NAMES = ("no-spec", "mtp1", "fixed-k", "scheduled", "colocated", "decoupled")


def _by_concurrency(result: dict, arm: str, key: str) -> dict[int, float]:
    levels = result["arms"].get(arm, {}).get("levels") or []
    return {lv["concurrency"]: lv[key] for lv in levels if lv.get(key) is not None}


def _pass_ratios(result: dict, arm: str, ref: str) -> dict[str, list[float]]:
    """Interleaved runs: arm / ref throughput per pass at each level (how far noise moves the ratio)."""
    a = _by_concurrency(result, arm, "pass_throughput_tok_s")
    b = _by_concurrency(result, ref, "pass_throughput_tok_s")
    return {str(c): [x / y for x, y in zip(a[c], b[c]) if y] for c in a if c in b}


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Rank correlation (average ranks for ties); None with fewer than 2 points or a constant side."""
    def ranks(vs: list[float]) -> list[float]:
        order = sorted(range(len(vs)), key=lambda i: vs[i])
        out = [0.0] * len(vs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and vs[order[j + 1]] == vs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def at_matched_throughput(result: dict, arm: str, ref: str = "mtp1") -> dict[str, dict[str, float | str]]:
    """At each of `ref`'s levels, `arm`'s median TPS/user at `ref`'s throughput (linear between `arm`'s two
    levels around it) over `ref`'s: what a user gets from each at the same load on the machine. Levels of
    `ref` outside `arm`'s throughput range say so ("below" / "above" it) instead of extrapolating."""
    thr, tps = (_by_concurrency(result, arm, k) for k in ("output_throughput_tok_s", "tps_user_median"))
    curve = sorted((thr[c], tps[c]) for c in thr if c in tps)
    ref_thr, ref_tps = (_by_concurrency(result, ref, k) for k in ("output_throughput_tok_s", "tps_user_median"))
    out: dict[str, dict[str, float | str]] = {}
    if not curve:
        return out
    for c in sorted(c for c in ref_thr if c in ref_tps):
        x = ref_thr[c]
        if x < curve[0][0] or x > curve[-1][0]:
            out[str(c)] = {"throughput_tok_s": x, "out_of_range": "below" if x < curve[0][0] else "above"}
            continue
        i = bisect.bisect_left(curve, (x,))  # the first of the arm's levels at or above x
        (x1, y1), (x0, y0) = curve[i], curve[max(i - 1, 0)]
        y = y1 if x1 == x else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
        out[str(c)] = {"throughput_tok_s": x, "tps_user": y, f"{ref}_tps_user": ref_tps[c],
                       "ratio": y / ref_tps[c] if ref_tps[c] else float("nan")}
    return out


def summarize(result: dict) -> dict:
    """Throughput ratios per level vs `no-spec` and `fixed-k`, and flags for the arms that exist."""
    thr = {arm: _by_concurrency(result, arm, "output_throughput_tok_s") for arm in result["arms"]}
    tps = {arm: _by_concurrency(result, arm, "tps_user_median") for arm in result["arms"]}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for ref, tag in (("no-spec", "vs_no_spec"), ("fixed-k", "vs_fixed_k")):
        if not thr.get(ref):
            continue
        for arm, by_c in thr.items():
            for c, value in by_c.items():
                if thr[ref].get(c):
                    ratios.setdefault(arm, {}).setdefault(str(c), {})[tag] = value / thr[ref][c]
                if tps[arm].get(c) and tps[ref].get(c):  # the "median TPS/user" over the reference's
                    ratios.setdefault(arm, {}).setdefault(str(c), {})[f"tps_user_{tag}"] = tps[arm][c] / tps[ref][c]
    for arm in result["arms"]:  # request by request, paired with the reference arm's (interleaved runs)
        for lv in result["arms"][arm].get("levels") or []:
            paired = lv.get("tps_user_paired")
            if paired:
                ratios.setdefault(arm, {}).setdefault(str(lv["concurrency"]), {})[
                    f"tps_user_paired_vs_{paired['reference'].replace('-', '_')}"] = paired["p50"]
    flags: dict[str, Any] = {}
    sched = thr.get("scheduled")
    if sched and thr.get("no-spec"):
        common = [c for c in sched if c in thr["no-spec"]]
        if common:
            flags["scheduled_never_below_no_spec"] = all(sched[c] >= thr["no-spec"][c] for c in common)
            flags["scheduled_min_ratio_vs_no_spec"] = min(sched[c] / thr["no-spec"][c] for c in common)
    by_pass = _pass_ratios(result, "scheduled", "no-spec")
    if by_pass:
        flags["scheduled_vs_no_spec_by_pass"] = by_pass
        # the bar is per pass: a level's total can hide one pass below no-spec
        flags["scheduled_never_below_no_spec_in_any_pass"] = all(r >= 1.0 for ratios in by_pass.values()
                                                                  for r in ratios)
    if sched and thr.get("fixed-k"):
        high = [c for c in sched if c >= 8 and c in thr["fixed-k"]]
        if high:
            flags["scheduled_ge_fixed_k_at_c_ge_8"] = all(sched[c] >= thr["fixed-k"][c] for c in high)
    verify_trend = {}
    for arm in result["arms"]:
        by_c = _by_concurrency(result, arm, "mean_verify_len")
        if len(by_c) >= 2 and any(by_c.values()):
            cs = sorted(by_c)
            verify_trend[arm] = {"falls": by_c[cs[-1]] < by_c[cs[0]],
                                 "spearman": spearman(cs, [by_c[c] for c in cs]),
                                 "lowest_c": by_c[cs[0]], "highest_c": by_c[cs[-1]]}
    if "scheduled" in verify_trend:
        flags["verify_len_falls_with_concurrency"] = verify_trend["scheduled"]["falls"]
    matched = {arm: m for arm in result["arms"] if arm != "mtp1" and (m := at_matched_throughput(result, arm))}
    return {"ratios": ratios, "flags": flags, "verify_len_trend": verify_trend,
            # the paper's comparison: TPS/user against MTP-1's at MTP-1's throughput, level by level
            **({"tps_user_vs_mtp1_at_matched_throughput": matched} if matched else {}),
            "num_errors": {arm: sum(lv["num_errors"] for lv in a.get("levels", [])) for arm, a in
                           result["arms"].items()},
            "arm_errors": {arm: a["error"] for arm, a in result["arms"].items() if a.get("error")}}
