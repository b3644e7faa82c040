"""`dspark bench serve` end to end on the tiny model (real Ray Serve, real HTTP), and its summary flags."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from dspark.bench.load import (
    LevelResult,
    LoadConfig,
    RequestRecord,
    merge_levels,
    num_warmup_for,
    request_body,
    stream_one,
    summarize_level,
)
from dspark.bench.quartiles import quartiles
from dspark.bench.serve_bench import ServeBenchConfig, pass_size, validate_arms
from dspark.bench.serve_pairs import paired_summary, paired_tps_user_ratios
from dspark.bench.serve_summary import spearman, summarize
from dspark.cli import app

MAX_TOKENS = 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_serve_sweeps_a_real_server_and_writes_json_and_plots(
        tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a 2-core machine running other work can starve the Serve proxy for a while: be patient with it
    for var in ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"):
        monkeypatch.setenv(var, "60")
    out = tmp_path / "serve.json"
    res = CliRunner().invoke(app, [
        "bench", "serve", "--target", str(tiny_target_dir), "--drafter", "ngram", "--num-draft-tokens", "4",
        "--arms", "fixed-k", "--concurrency", "1,2", "--num-requests", "3", "--num-warmup", "1",
        "--max-tokens", str(MAX_TOKENS), "--set", "max_model_len=512", "--set", "num_threads=1",
        "--keep-requests", "--out", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result
    arm = result["arms"]["fixed-k"]
    assert "error" not in arm, arm
    assert arm["config"]["scheduler"] == "fixed" and arm["config"]["scheduler_kwargs"] == {"k": 4}
    assert [lv["concurrency"] for lv in arm["levels"]] == [1, 2]
    for level in arm["levels"]:
        assert level["num_errors"] == 0, level["errors"]
        assert level["num_requests"] == 3
        assert [r["completion_tokens"] for r in level["requests"]] == [MAX_TOKENS] * 3
        assert level["num_wrong_length"] == 0
        assert level["output_throughput_tok_s"] > 0 and level["tps_user_median"] > 0
        assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"]
        assert 1 <= level["tau"] <= 4 + 1
        assert 0 <= level["mean_verify_len"] <= 4
        assert all(r["num_steps"] >= 1 for r in level["requests"])
    # throughput vs TPS/user, verify length, and the (inline) engine's step timeline from /v1/dspark/stats
    assert [Path(p).name for p in result["plots"]][:2] == ["serve_throughput_vs_tps_user.png", "serve_verify_len.png"]
    assert len(result["plots"]) == 3 and Path(result["plots"][2]).name.startswith("serve_timeline_")
    for path in result["plots"]:
        assert Path(path).read_bytes()[:8] == PNG_MAGIC


def test_interleaved_arms_run_side_by_side_in_passes_and_pair_their_requests(
        tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"):
        monkeypatch.setenv(var, "60")
    res = CliRunner().invoke(app, [
        "bench", "serve", "--target", str(tiny_target_dir), "--drafter", "ngram", "--num-draft-tokens", "4",
        "--arms", "no-spec,scheduled", "--interleave", "--concurrency", "1,2", "--num-requests", "4",
        "--num-warmup", "1", "--max-tokens", str(MAX_TOKENS), "--set", "max_model_len=512",
        "--set", "num_threads=1", "--set", "draft_gate=false", "--keep-requests", "--alone", "--passes", "3"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout.strip().splitlines()[-1])
    # three passes of half the level's requests: in order, reversed, in order
    assert result["interleave"] is True and result["passes"] == 3 and result["num_requests"] == {"1": 6, "2": 6}
    # who used the cores: the idle apps with no load, and per pass the arm under test (its replicas found by
    # their process titles) beside the rest; each arm again alone, beside its interleaved figure
    assert result["idle_cores"]["machine"] >= 0 and "peer" not in result["idle_cores"]
    fair = result["summary"]["fairness"]
    for name in ("no-spec", "scheduled"):
        arm = result["arms"][name]
        assert [lv["concurrency"] for lv in arm["alone_levels"]] == [1, 2] and arm["alone_error"] is None
        assert all(lv["num_errors"] == 0 and lv["num_requests"] == 6 for lv in arm["alone_levels"])
        # alone, each level runs as the interleaved ones do: three passes of half the requests
        assert all(len(lv["pass_throughput_tok_s"]) == 3 for lv in arm["alone_levels"])
        for level in arm["levels"]:
            passes = level["pass_cores_by_group"]
            assert len(passes) == 3 and all(p.get(f"arm:{name}", 0) > 0 for p in passes), passes
            assert len(level["pass_tps_user_median"]) == 3 and min(level["pass_tps_user_median"]) > 0
        for c in ("1", "2"):
            row = fair["levels"][name][c]
            assert row["alone_tok_s"] > 0 and row["interleaved_tok_s"] > 0 and row["noise"] >= 0.05
            assert row["alone_over_interleaved"] == pytest.approx(row["alone_tok_s"] / row["interleaved_tok_s"],
                                                                  rel=1e-2)
            assert row["agree_within_noise"] == (abs(row["alone_over_interleaved"] - 1) <= row["noise"])
    for name in ("no-spec", "scheduled"):
        arm = result["arms"][name]
        assert "error" not in arm, arm
        assert arm["route_prefix"] == f"/{name}" and arm["config"]["cluster_name"] == f"bench-{name}"
        for level in arm["levels"]:
            assert level["num_errors"] == 0, level["errors"]
            assert level["num_requests"] == 6  # three passes of 2
            assert [r["completion_tokens"] for r in level["requests"]] == [MAX_TOKENS] * 6
            assert len(level["pass_throughput_tok_s"]) == 3 and min(level["pass_throughput_tok_s"]) > 0
    # each route reached its own app: only the scheduled one verified drafts
    assert any(lv["mean_verify_len"] > 0 for lv in result["arms"]["scheduled"]["levels"])
    assert all(lv["mean_verify_len"] == 0 for lv in result["arms"]["no-spec"]["levels"])
    by_pass = result["summary"]["flags"]["scheduled_vs_no_spec_by_pass"]
    assert set(by_pass) == {"1", "2"} and all(len(v) == 3 and min(v) > 0 for v in by_pass.values())
    # every scheduled request paired with no-spec's on the same prompt in the same pass; the reference has none
    for level in result["arms"]["scheduled"]["levels"]:
        paired = level["tps_user_paired"]
        assert paired["reference"] == "no-spec" and paired["num_pairs"] == 6
        assert 0 < paired["min"] <= paired["p25"] <= paired["p50"] <= paired["p75"] <= paired["max"]
        ratios = result["summary"]["ratios"]["scheduled"][str(level["concurrency"])]
        assert ratios["tps_user_paired_vs_no_spec"] == paired["p50"]
        assert ratios["tps_user_vs_no_spec"] > 0
    assert all("tps_user_paired" not in lv for lv in result["arms"]["no-spec"]["levels"])


def test_merged_passes_pool_tokens_over_summed_time_and_pass_sizes_reach_the_level() -> None:
    def rec(n: int) -> RequestRecord:
        return RequestRecord(ttft_s=0.1, decode_s=1.0, completion_tokens=n)

    merged = merge_levels([LevelResult(2, 2.0, [rec(8), rec(8)], 1), LevelResult(2, 6.0, [rec(8), rec(8)], 0)])
    assert merged.wall_s == 8.0 and len(merged.records) == 4 and merged.num_warmup_errors == 1
    assert summarize_level(merged, 8)["output_throughput_tok_s"] == 32 / 8.0
    with pytest.raises(ValueError, match="one concurrency"):
        merge_levels([LevelResult(1, 1.0), LevelResult(2, 1.0)])
    load = LoadConfig(base_url="")
    assert [pass_size(load, c) for c in (1, 4, 8, 32)] == [4, 4, 8, 32]  # half of max(2C, 8), at least C
    assert pass_size(LoadConfig(base_url="", num_requests=5), 1) == 3
    waves = LoadConfig(base_url="", waves=3)  # clients send again as theirs finish: 3 waves of C per pass
    assert [pass_size(waves, c) for c in (1, 4, 32)] == [4, 12, 96]
    # warm-up loads the whole batch once per turn; 0 turns it off
    assert [num_warmup_for(load, c) for c in (1, 2, 32)] == [2, 2, 32]
    assert num_warmup_for(LoadConfig(base_url="", num_warmup=0), 32) == 0


def test_paired_ratios_match_request_i_of_each_pass_and_skip_failures() -> None:
    def rec(decode_s: float, error: str | None = None) -> RequestRecord:
        return RequestRecord(ttft_s=0.1, decode_s=decode_s, completion_tokens=9, error=error)

    ref = [LevelResult(1, 1.0, [rec(1.0), rec(2.0)]), LevelResult(1, 1.0, [rec(4.0), rec(1.0)])]
    arm = [LevelResult(1, 1.0, [rec(0.5), rec(1.0)]), LevelResult(1, 1.0, [rec(1.0), rec(1.0, "HTTP 500")])]
    # 8 tokens after the first: 16 vs 8, 8 vs 4, 8 vs 2 tok/s; the failed request has no pair
    assert paired_tps_user_ratios(arm, ref) == [2.0, 2.0, 4.0]
    summary = paired_summary(arm, ref)
    assert summary == {"p25": 2.0, "p50": 2.0, "p75": 3.0, "min": 2.0, "max": 4.0, "num_pairs": 3}
    assert paired_summary([LevelResult(1, 1.0, [rec(1.0, "boom")])], [LevelResult(1, 1.0, [rec(1.0)])]) is None
    with pytest.raises(ValueError, match="paired passes"):
        paired_tps_user_ratios(arm, ref[:1])
    assert quartiles([3.0]) == {"p25": 3.0, "p50": 3.0, "p75": 3.0, "min": 3.0, "max": 3.0}
    with pytest.raises(ValueError):
        quartiles([])


def test_summary_gives_tps_user_ratios_of_medians_and_paired() -> None:
    result = _result({"no-spec": [{**_level(2, 100), "tps_user_median": 40.0}],
                      "scheduled": [{**_level(2, 140, 3.0), "tps_user_median": 60.0,
                                     "tps_user_paired": {"reference": "no-spec", "p50": 1.55, "num_pairs": 8}}]})
    ratios = summarize(result)["ratios"]["scheduled"]["2"]
    assert ratios == {"vs_no_spec": 1.4, "tps_user_vs_no_spec": 1.5, "tps_user_paired_vs_no_spec": 1.55}


def test_tps_user_against_mtp1_is_read_at_mtp1s_throughput_on_the_arms_curve() -> None:
    def lv(c: int, thr: float, tps: float) -> dict:
        return {**_level(c, thr), "tps_user_median": tps}

    result = _result({"mtp1": [lv(1, 40, 45), lv(2, 90, 42), lv(4, 150, 38), lv(32, 500, 10)],
                      "scheduled": [lv(1, 60, 80), lv(2, 100, 70), lv(4, 200, 50)]})
    matched = summarize(result)["tps_user_vs_mtp1_at_matched_throughput"]
    assert set(matched) == {"scheduled"}  # MTP-1 is not compared with itself
    at = matched["scheduled"]
    # 90 tok/s lies a quarter of the way from the arm's 60 to its 100: 80 - 0.75 * 10 = 72.5 TPS/user
    assert at["2"] == {"throughput_tok_s": 90, "tps_user": 72.5, "mtp1_tps_user": 42, "ratio": 72.5 / 42}
    assert at["4"]["tps_user"] == 60.0 and at["4"]["ratio"] == 60.0 / 38
    # outside the arm's range: said, not extrapolated
    assert at["1"] == {"throughput_tok_s": 40, "out_of_range": "below"}
    assert at["32"] == {"throughput_tok_s": 500, "out_of_range": "above"}
    assert "tps_user_vs_mtp1_at_matched_throughput" not in summarize(_result({"scheduled": [lv(1, 60, 80)]}))


def test_interleaved_arms_must_route_apart() -> None:
    cfg = ServeBenchConfig(arms={"a b": {"drafter": "none"}, "a-b": {"drafter": "none"}}, interleave=True)
    with pytest.raises(ValueError, match="clashing route prefixes"):
        validate_arms(cfg)
    validate_arms(ServeBenchConfig(arms={"a b": {"drafter": "none"}, "a-b": {"drafter": "none"}}))
    with pytest.raises(ValueError, match="passes must be at least 2"):
        validate_arms(ServeBenchConfig(arms={"a": {"drafter": "none"}}, interleave=True, passes=1))


def _level(c: int, thr: float, verify_len: float | None = None) -> dict:
    return {"concurrency": c, "output_throughput_tok_s": thr, "mean_verify_len": verify_len, "num_errors": 0}


def _result(arms: dict[str, list[dict]]) -> dict:
    return {"arms": {name: {"levels": levels} for name, levels in arms.items()}}


def test_summary_ratios_and_flags_from_a_hand_made_result() -> None:
    result = _result({
        "no-spec": [_level(1, 100), _level(8, 400), _level(32, 800)],
        "fixed-k": [_level(1, 200, 7), _level(8, 500, 7), _level(32, 700, 7)],
        "scheduled": [_level(1, 210, 6.5), _level(8, 520, 4.0), _level(32, 900, 1.5)],
    })
    summary = summarize(result)
    assert summary["ratios"]["scheduled"]["8"] == {"vs_no_spec": 1.3, "vs_fixed_k": 520 / 500}
    assert summary["ratios"]["fixed-k"]["32"]["vs_no_spec"] == 700 / 800
    assert summary["flags"] == {"scheduled_never_below_no_spec": True, "scheduled_min_ratio_vs_no_spec": 1.125,
                                "scheduled_ge_fixed_k_at_c_ge_8": True, "verify_len_falls_with_concurrency": True}
    assert summary["verify_len_trend"]["scheduled"]["spearman"] == -1.0
    assert summary["verify_len_trend"]["fixed-k"]["falls"] is False
    assert "no-spec" not in summary["verify_len_trend"]  # it verifies nothing

    result["arms"]["scheduled"]["levels"][2]["output_throughput_tok_s"] = 650  # below both at C=32
    flags = summarize(result)["flags"]
    assert flags["scheduled_never_below_no_spec"] is False
    assert flags["scheduled_ge_fixed_k_at_c_ge_8"] is False


def test_summary_flags_are_absent_without_their_arms() -> None:
    only = summarize(_result({"scheduled": [_level(1, 10, 3.0), _level(2, 15, 3.0)]}))
    assert only["flags"] == {"verify_len_falls_with_concurrency": False}
    assert only["ratios"] == {}
    failed = summarize({"arms": {"no-spec": {"error": "boom"}, "scheduled": {"levels": [_level(4, 10)]}}})
    assert failed["flags"] == {} and failed["arm_errors"] == {"no-spec": "boom"}


def test_spearman_handles_ties_and_degenerate_input() -> None:
    assert spearman([1, 2, 4, 8], [5, 4, 4, 1]) == pytest.approx(-0.9486833)
    assert spearman([1, 2], [3, 3]) is None
    assert spearman([1], [1]) is None


def _sse(*events: object) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


VLLM_STREAM = _sse(  # role-only first chunk, then content, then a usage-only chunk (choices empty)
    {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"delta": {"content": "one"}}]},
    {"choices": [{"delta": {"content": " two"}, "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    "[DONE]")


def _record(reply: httpx.Response) -> RequestRecord:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return reply

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://peer") as client:
            body = request_body(LoadConfig(base_url="", max_tokens=2, model="m"), [{"role": "user", "content": "x"}],
                                index=3)
            return await stream_one(client, body)

    rec = asyncio.run(go())
    assert seen[0]["seed"] == 3 and seen[0]["ignore_eos"] and seen[0]["model"] == "m" and seen[0]["stream"]
    return rec


def test_a_peer_stream_without_dspark_stats_is_timed_but_has_no_spec_figures() -> None:
    rec = _record(httpx.Response(200, content=VLLM_STREAM))
    assert rec.error is None and rec.completion_tokens == 2
    assert rec.ttft_s >= 0 and rec.decode_s >= 0 and rec.num_steps is None
    level = summarize_level(LevelResult(1, 0.5, [rec]), max_tokens=2)
    assert level["output_throughput_tok_s"] == 4.0 and level["tau"] is None and level["num_errors"] == 0


@pytest.mark.parametrize(("reply", "reason"), [
    (httpx.Response(500, text="boom"), "HTTP 500: boom"),
    (httpx.Response(200, content=_sse({"error": {"message": "engine died"}}, "[DONE]")), "engine died"),
    (httpx.Response(200, content=VLLM_STREAM.replace(b"data: [DONE]", b"")), "without [DONE]"),
])
def test_failed_requests_are_recorded_with_their_reason_and_counted(reply: httpx.Response, reason: str) -> None:
    rec = _record(reply)
    assert rec.error is not None and reason in rec.error
    level = summarize_level(LevelResult(1, 1.0, [rec]), max_tokens=2)
    assert level["num_errors"] == 1 and level["output_throughput_tok_s"] == 0.0 and reason in level["errors"][0]


def test_a_pass_below_no_spec_fails_the_per_pass_flag_even_when_the_level_total_is_above() -> None:
    result = _result({"no-spec": [_level(16, 300)], "scheduled": [_level(16, 310, 1.4)]})
    result["arms"]["no-spec"]["levels"][0]["pass_throughput_tok_s"] = [290.0, 310.0]
    result["arms"]["scheduled"]["levels"][0]["pass_throughput_tok_s"] = [289.0, 331.0]
    flags = summarize(result)["flags"]
    assert flags["scheduled_never_below_no_spec"] is True  # the level's total: 310 against 300
    assert flags["scheduled_never_below_no_spec_in_any_pass"] is False  # pass 1: 289 against 290
    result["arms"]["scheduled"]["levels"][0]["pass_throughput_tok_s"] = [291.0, 331.0]
    assert summarize(result)["flags"]["scheduled_never_below_no_spec_in_any_pass"] is True
