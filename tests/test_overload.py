"""10x the admission limit at once against the real Serve app (tiny model, loopback): every admitted request
completes, every other one is a 429/503 with Retry-After and a reason, no other 5xx, nothing left behind."""

from __future__ import annotations

from pathlib import Path

from dspark.bench.overload import run_overload
from tests.test_serve_http import MAX_MODEL_LEN, MODEL


def test_ten_times_the_limit_is_refused_cleanly_and_admitted_requests_complete(tiny_target_dir: Path) -> None:
    args = {"target": str(tiny_target_dir), "model_name": MODEL, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 2,
            "max_queued_requests": 2, "num_threads": 1, "drafter": "ngram", "scheduler": "fixed",
            "num_draft_tokens": 3}
    res = run_overload(args, multiple=10, max_tokens=24)
    assert res["num_sent"] == 40
    assert res["num_admitted_ok"] + res["num_refused"] == res["num_sent"], res
    assert res["num_admitted_ok"] >= res["admission_limit"]
    assert res["num_refused"] > 0 and res["num_other"] == 0 and res["num_5xx_other_than_503"] == 0
    assert res["num_refused_with_retry_after"] == res["num_refused_with_reason"] == res["num_refused"]
    assert res["engines_after"] == {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                                    "dspark_draft_contexts": 0.0}
