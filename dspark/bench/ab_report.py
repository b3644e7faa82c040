"""`dspark ab report`: per-arm figures of an A/B run and bootstrap confidence intervals of their differences.

Input: the ingress's request log (JSONL, one record per finished request: arm, start_s, ttft_s, e2e_s,
num_output_tokens, num_steps, num_verified, is_error). Per arm: median TPS/user (output tokens over the
decode time), TTFT p50 / p99, output throughput (tokens over the arm's busy span), τ (tokens per step),
mean verification length (draft tokens verified per step), error rate. For every metric, the difference
of each arm against the first (the baseline) with a percentile bootstrap interval (requests resampled
within each arm, seeded) at the stated α. The verdict names the arm that is better on the primary metric
(median TPS/user) with an interval excluding 0, and says whether the sample is large enough: the
primary interval's half-width must be within `min_effect` of the baseline's value.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

HIGHER_IS_BETTER = {"tps_user_p50": True, "ttft_p50_s": False, "ttft_p99_s": False, "throughput_tok_s": True,
                    "tau": True, "verify_len": True, "error_rate": False}
PRIMARY = "tps_user_p50"


def load_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def arm_metrics(records: list[dict]) -> dict[str, float]:
    # a request whose client hung up (is_aborted) is neither a success to time nor a server error
    ok = [r for r in records if not r.get("is_error") and not r.get("is_aborted")]
    decode = [r["num_output_tokens"] / (r["e2e_s"] - r["ttft_s"]) for r in ok
              if r["e2e_s"] > r["ttft_s"] and r["num_output_tokens"] > 1]
    span = (max((r["start_s"] + r["e2e_s"] for r in ok), default=0.0) - min((r["start_s"] for r in ok), default=0.0))
    steps = sum(r.get("num_steps", 0) for r in ok)
    return {
        "num_requests": float(len(records)),
        "num_aborted": float(sum(1 for r in records if r.get("is_aborted"))),
        "tps_user_p50": statistics.median(decode) if decode else float("nan"),
        "ttft_p50_s": _quantile([r["ttft_s"] for r in ok], 0.5),
        "ttft_p99_s": _quantile([r["ttft_s"] for r in ok], 0.99),
        "throughput_tok_s": sum(r["num_output_tokens"] for r in ok) / span if span > 0 else float("nan"),
        "tau": sum(r["num_output_tokens"] for r in ok) / steps if steps else float("nan"),
        "verify_len": sum(r.get("num_verified", 0) for r in ok) / steps if steps else float("nan"),
        "error_rate": sum(1 for r in records if r.get("is_error")) / len(records) if records else float("nan"),
    }


def _bootstrap(base: list[dict], other: list[dict], num_resamples: int, alpha: float,
               rng: random.Random) -> dict[str, tuple[float, float]]:
    """Percentile intervals of other − base for every metric (requests resampled within each arm)."""
    diffs: dict[str, list[float]] = {name: [] for name in HIGHER_IS_BETTER}
    for _ in range(num_resamples):
        a = arm_metrics([base[rng.randrange(len(base))] for _ in base])
        b = arm_metrics([other[rng.randrange(len(other))] for _ in other])
        for name in HIGHER_IS_BETTER:
            if not math.isnan(b[name] - a[name]):
                diffs[name].append(b[name] - a[name])
    return {name: (_quantile(d, alpha / 2), _quantile(d, 1 - alpha / 2)) for name, d in diffs.items()}


def ab_report(records: list[dict], alpha: float = 0.05, num_resamples: int = 1000, min_effect: float = 0.05,
              seed: int = 0) -> dict:
    by_arm: dict[str, list[dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], []).append(r)
    if len(by_arm) < 2:
        raise ValueError(f"an A/B report needs two arms in the log, got {sorted(by_arm)}")
    arms = list(by_arm)
    base = arms[0]
    rng = random.Random(seed)
    res: dict = {"alpha": alpha, "num_resamples": num_resamples, "baseline": base,
                 "arms": {a: arm_metrics(rs) for a, rs in by_arm.items()}, "differences": {}}
    for arm in arms[1:]:
        diffs = {}
        intervals = _bootstrap(by_arm[base], by_arm[arm], num_resamples, alpha, rng)
        for name in HIGHER_IS_BETTER:
            lo, hi = intervals[name]
            point = res["arms"][arm][name] - res["arms"][base][name]
            better = (lo > 0) if HIGHER_IS_BETTER[name] else (hi < 0)
            worse = (hi < 0) if HIGHER_IS_BETTER[name] else (lo > 0)
            diffs[name] = {"difference": point, "ci": [lo, hi],
                           "verdict": f"{arm} better" if better else f"{arm} worse" if worse else "no difference"}
        res["differences"][arm] = diffs
    res["verdict"] = _verdict(res, arms, min_effect)
    return res


def _verdict(res: dict, arms: list[str], min_effect: float) -> dict:
    base = arms[0]
    base_value = res["arms"][base][PRIMARY]
    out: dict = {"primary_metric": PRIMARY, "min_effect": min_effect}
    winners = [a for a in arms[1:] if res["differences"][a][PRIMARY]["verdict"] == f"{a} better"]
    losers = [a for a in arms[1:] if res["differences"][a][PRIMARY]["verdict"] == f"{a} worse"]
    out["winner"] = winners[0] if winners else (base if losers and len(losers) == len(arms) - 1 else None)
    widths = [(d[PRIMARY]["ci"][1] - d[PRIMARY]["ci"][0]) / 2 for d in res["differences"].values()]
    half = max(widths) if widths else float("nan")
    out["ci_half_width"] = half
    out["is_sample_large_enough"] = bool(half <= min_effect * abs(base_value)) if base_value == base_value else False
    n = min(res["arms"][a]["num_requests"] for a in arms)
    if not out["is_sample_large_enough"] and base_value and half == half:
        out["requests_per_arm_needed"] = math.ceil(n * (half / (min_effect * abs(base_value))) ** 2)
    return out
