"""10x the admission limit, at 10x the measured completion rate and then all at once, against the real Serve
app (tiny model, loopback): every admitted request
completes, every other one is a 429/503 with Retry-After and a reason, no other 5xx, nothing left behind."""

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
    assert res["num_5xx_other_than_503"] == 0 and res["num_no_response"] == 0, res
    assert res["phases"]["calibrate"]["num_admitted_ok"] == limit  # the limit's worth is all admitted
    for name in ("sustained", "sustained_2", "burst"):
        phase = res["phases"][name]
        assert phase["num_sent"] == 10 * limit
        assert phase["num_admitted_ok"] + phase["num_refused"] == phase["num_sent"], phase
        assert phase["num_refused"] > 0 and phase["num_other"] == 0, phase
        assert phase["num_refused_with_retry_after"] == phase["num_refused_with_reason"] == phase["num_refused"]
    assert res["phases"]["burst"]["num_admitted_ok"] >= limit
    assert all(res["phases"][p]["rss_peak_mb"] > 0 for p in ("calibrate", "sustained", "sustained_2", "burst"))
    assert len(res["rss_mb"]["sustained_peak_growth"]) == 1
    mem = res["rss_mb"]  # the bound is stated from full load (calibrate), before the overload phases
    assert mem["bound"] == round(mem["full_load_peak"] + 512.0, 1) == round(
        res["phases"]["calibrate"]["rss_peak_mb"] + 512.0, 1)
    assert mem["overload_peak"] == max(res["phases"][p]["rss_peak_mb"] for p in ("sustained", "sustained_2", "burst"))
    # where each phase's CPU went, per request: the ingress and Serve's proxy did work in every phase. Process
    # CPU times tick in 10 ms, so over the calibrate phase's few requests the proxy's share can round to no
    # tick at all (seen once in a full run); the overload phases send 10x as many
    for p in ("calibrate", "sustained", "burst"):
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
