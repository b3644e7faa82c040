"""10x the admission limit, at 10x the measured completion rate and then all at once, against the real Serve
app (tiny model, loopback), with the static limit and with admission by predicted latency one after the other:
every admitted request completes, every other one is a 429/503 with Retry-After and a reason, no other
status, goodput and SLA attainment reported for both, nothing left behind."""

from __future__ import annotations

from pathlib import Path

from dspark.bench.overload import run_overload
from tests.test_serve_http import MODEL


def test_ten_times_the_limit_is_refused_cleanly_and_admitted_requests_complete(tiny_target_dir: Path) -> None:
    args = {"target": str(tiny_target_dir), "model_name": MODEL, "max_model_len": 2048, "max_num_seqs": 2,
            "max_queued_requests": 2, "num_threads": 1, "drafter": "ngram", "scheduler": "fixed",
            "num_draft_tokens": 3}
    res = run_overload(args, multiple=10, max_tokens=24, hangup_max_tokens=2000, repeat=2)
    limit = res["admission_limit"]
    assert res["num_other_than_200_429_503"] == 0 and res["num_no_response"] == 0, res
    assert res["phases"]["calibrate"]["num_admitted_ok"] == limit  # the limit's worth is all admitted
    phases = ("static:sustained", "static:sustained_2", "static:burst", "sla:sustained", "sla:sustained_2",
              "sla:burst")
    for name in phases:
        phase = res["phases"][name]
        assert phase["num_sent"] == 10 * limit
        assert phase["num_admitted_ok"] + phase["num_refused"] == phase["num_sent"], phase
        assert phase["num_refused"] > 0 and phase["num_other"] == 0, phase
        assert phase["num_refused_with_retry_after"] == phase["num_refused_with_reason"] == phase["num_refused"]
        assert phase["num_admitted_ok"] > 0 and phase["goodput_rps"] >= 0 and phase["admitted_ttft_s"]["p50"] > 0
    assert res["phases"]["static:burst"]["num_admitted_ok"] >= limit
    for kind in ("sustained", "burst"):  # side by side
        assert set(res["comparison"][kind]) == {"static", "sla"}
        assert all(row["sla_attainment"] is not None for row in res["comparison"][kind].values())
    assert all(res["phases"][p]["rss_peak_mb"] > 0 for p in ("calibrate", *phases))
    assert len(res["rss_mb"]["sustained_peak_growth"]) == 3
    mem = res["rss_mb"]  # the bound is stated from full load (calibrate), before the overload phases
    assert mem["bound"] == round(mem["full_load_peak"] + 512.0, 1) == round(
        res["phases"]["calibrate"]["rss_peak_mb"] + 512.0, 1)
    assert mem["overload_peak"] == max(res["phases"][p]["rss_peak_mb"] for p in phases)
    # where each phase's CPU went, per request: the ingress and Serve's proxy did work in every phase. Process
    # CPU times tick in 10 ms, so over the calibrate phase's few requests the proxy's share can round to no
    # tick at all (seen once in a full run); the overload phases send 10x as many
    for p in ("calibrate", "static:sustained", "static:burst", "sla:sustained"):
        cpu = res["phases"][p]["cpu_ms_per_request"]
        assert any("SpecDecodeServer" in k for k in cpu), cpu
        assert p == "calibrate" or any(k.startswith("ray::ProxyActor") for k in cpu), cpu
    gone = res["phases"]["disconnect"]
    assert gone["num_hung_up"] == gone["num_streams"] > 0 and gone["freed_within_s"] is not None, gone
    # every hang-up reached the ingress before its stream could finish (2,000 tokens: seconds even here), and
    # closing the engine's stream aborted the request: none ended as `length`, and the engines hold nothing
    assert gone["num_recorded_aborted"] == gone["num_streams"], gone
    assert res["engines_after"] == {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                                    "dspark_draft_contexts": 0.0}
