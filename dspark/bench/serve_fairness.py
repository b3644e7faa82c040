"""Is a serving comparison fair? Each arm alone beside its interleaved figure, and who used the cores.

An interleaved run (every arm up at once, ABBA passes) cancels drift, but on a small machine the arms that
wait still cost something: idle replicas, heartbeats, thread pools, a paused-or-not peer. So `bench serve
--interleave --alone` measures each arm a second time with only that arm deployed, and this summary puts
the two side by side per level: the alone ÷ interleaved throughput ratio, the pass-to-pass spread of the
interleaved figure (the noise), and whether they agree within it. The cores each process group used
during an arm's turn (`cores_by_group`, from `cpu_time`) say where a difference went.
"""

from __future__ import annotations

from typing import Any

MIN_NOISE = 0.05  # below this pass-to-pass spread, 5% is what two runs of one arm differ by anyway


def _spread(passes: list[float]) -> float:
    """Relative spread of one arm's figure between passes: (max - min) / mean."""
    mean = sum(passes) / len(passes) if passes else 0.0
    return (max(passes) - min(passes)) / mean if mean else 0.0


def interference(cores: dict[str, float], arm: str) -> float:
    """Cores that something other than `arm` and the load generator used during the arm's turn."""
    mine = {f"arm:{arm}", "load generator", "machine"}
    return round(sum(v for g, v in cores.items() if g not in mine), 3)


def fairness_summary(result: dict) -> dict[str, Any]:
    """Per arm and level: interleaved and alone throughput and TPS/user, their ratio, the noise, and the
    verdict; plus the cores idle apps cost while nothing was loaded (`idle_cores`)."""
    out: dict[str, Any] = {"levels": {}, "all_agree_within_noise": True}
    for arm, body in result.get("arms", {}).items():
        alone = {lv["concurrency"]: lv for lv in body.get("alone_levels", [])}
        for lv in body.get("levels", []):
            c = lv["concurrency"]
            if c not in alone:
                continue
            a, i = alone[c], lv
            noise = max(_spread(i.get("pass_throughput_tok_s") or []), _spread(a.get("pass_throughput_tok_s") or []),
                        MIN_NOISE)
            ratio = round(a["output_throughput_tok_s"] / i["output_throughput_tok_s"], 3) \
                if i["output_throughput_tok_s"] else None
            noise = round(noise, 3)
            # judged on the figures reported, so the verdict is the one a reader of them would reach (unrounded,
            # 0.1480004 against a noise of 0.1479996 said "agree" beside a printed 0.852 and 0.148)
            agree = ratio is not None and abs(ratio - 1.0) <= noise
            out["all_agree_within_noise"] &= agree
            out["levels"].setdefault(arm, {})[str(c)] = {
                "interleaved_tok_s": i["output_throughput_tok_s"], "alone_tok_s": a["output_throughput_tok_s"],
                "interleaved_tps_user_median": i.get("tps_user_median"),
                "alone_tps_user_median": a.get("tps_user_median"),
                "interleaved_ttft_p50_s": i.get("ttft_p50_s"), "alone_ttft_p50_s": a.get("ttft_p50_s"),
                "alone_over_interleaved": ratio or None, "noise": noise,
                "agree_within_noise": agree,
                "interference_cores": [interference(p, arm) for p in i.get("pass_cores_by_group", [])],
            }
    return out
