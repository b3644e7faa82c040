"""The `dspark` CLI end to end on the tiny model: generate --json, profile, bench batching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dspark.cli import app
from dspark.spec.sps import SPSTable

runner = CliRunner()


def test_profile_writes_one_loadable_sps_table_per_dtype_named_after_this_machine(tiny_target_dir, tmp_path):
    from dspark.models.target.profiles import find_profile, machine_identity

    res = runner.invoke(app, ["profile", "--target", str(tiny_target_dir), "--out-dir", str(tmp_path),
                              "--dtypes", "fp32", "--max-tokens-per-step", "16", "--context-len", "32",
                              "--num-repeats", "2"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    (prof,) = report["profiles"]
    table = SPSTable.from_file(prof["out"])
    assert table.tokens_per_step[0] == 1 and table.tokens_per_step[-1] == 16
    assert all(t > 0 for t in table.step_time_ms)
    assert set(table.meta["verify_cost_ratio"]) == {"1", "3", "7"}  # T(1+l)/T(1) at batch 1
    # rows in a batched step's shape: R requests, R + n tokens (n drafts at most 7 a request), within the grid
    assert {r: row.tokens_per_step for r, row in table.by_requests.items()} == {
        2: [2, 3, 4, 6, 10], 4: [4, 5, 6, 8, 12], 8: [8, 9, 10, 12, 16], 16: [16]}
    assert table.for_requests(8).step_time_ms_at(8) == pytest.approx(table.by_requests[8].step_time_ms[0])
    assert set(report["dtype_choice"]["choice"]) == {"verify", "draft", "generate"}
    # the engine finds it for this machine, model and dtype, and for no other dtype
    ident = machine_identity(str(tiny_target_dir), "cpu", torch.float32)
    assert find_profile(ident, [tmp_path]) == Path(prof["out"])
    assert find_profile({**ident, "dtype": "bfloat16"}, [tmp_path]) is None


def test_profile_runs_take_each_sizes_median_over_whole_measurements(tiny_target_dir, tmp_path):
    res = runner.invoke(app, ["profile", "--target", str(tiny_target_dir), "--out-dir", str(tmp_path),
                              "--dtypes", "fp32", "--max-tokens-per-step", "8", "--context-len", "16",
                              "--num-repeats", "1", "--runs", "3"])
    assert res.exit_code == 0, res.output
    (prof,) = json.loads(res.stdout.strip().splitlines()[-1])["profiles"]
    table = SPSTable.from_file(prof["out"])
    assert table.meta["runs"] == 3 and set(table.meta["range_ms"]) == {str(n) for n in table.tokens_per_step}
    for n, ms in zip(table.tokens_per_step, table.step_time_ms):
        lo, hi = table.meta["range_ms"][str(n)]
        assert lo - 1e-3 <= ms <= hi + 1e-3  # a median lies within its runs' range
    assert sorted(table.by_requests) == [2, 4, 8] and all(
        t > 0 for row in table.by_requests.values() for t in row.step_time_ms)
    ratio = table.meta["verify_cost_ratio"]  # read off the median table, not one run's
    assert ratio["1"] == round(table.step_time_ms_at(2) / table.step_time_ms_at(1), 3)


def test_profile_runs_of_different_grids_are_refused():
    from dspark.models.target.profiles import median_of_runs

    a = SPSTable([1, 2], [1.0, 2.0], {"tokens_per_request": 8})
    b = SPSTable([1, 4], [1.0, 3.0], {"tokens_per_request": 8})
    with pytest.raises(ValueError, match="different grids"):
        median_of_runs([a, b])


def test_generate_json_reports_text_ids_and_steps(tiny_target_dir, tmp_path):
    profile = tmp_path / "p.json"
    SPSTable.from_sps({1: 100.0, 8: 80.0, 64: 20.0}).save(profile)
    res = runner.invoke(app, ["generate", "--prompt", "one two three one two three one two", "--target",
                              str(tiny_target_dir), "--drafter", "ngram", "--scheduler", "greedy",
                              "--sps-profile", str(profile), "--max-tokens", "12", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert 0 < len(out["token_ids"]) <= 12 and isinstance(out["text"], str)
    assert out["num_steps"] == len(out["steps"]) and out["tau"] >= 1


def test_generate_refuses_bad_input_with_a_reason(tiny_target_dir):
    res = runner.invoke(app, ["generate", "--prompt", "one", "--target", str(tiny_target_dir),
                              "--drafter", "nope", "--scheduler", "fixed"])
    assert res.exit_code == 2 and "unknown drafter" in res.output


def test_bench_batching_prints_json_last(tiny_target_dir):
    res = runner.invoke(app, ["bench", "batching", "--target", str(tiny_target_dir)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out["cases"]) and out["max_mixed_over_uniform"] > 0


def test_bench_decode_refills_the_batch_from_waves_of_prompts(tiny_target_dir):
    args = ["bench", "decode", "--target", str(tiny_target_dir), "--batch-sizes", "1,2", "--num-prompts", "1",
            "--max-new-tokens", "6", "--num-draft-tokens", "3", "--scheduler", "greedy", "--hf-dtypes", "",
            "--drafters", "ngram,oracle"]
    for waves, num_prompts in ((3, 6), (1, 2)):
        res = runner.invoke(app, [*args, "--waves", str(waves), "--rounds", "2"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout.strip().splitlines()[-1])
        b2 = out["batch2"]
        assert out["waves"] == waves and b2["num_prompts"] == num_prompts
        assert b2["continuous_batching"] is (waves > 1) and out["batch1"]["continuous_batching"] is False
        ngram = b2["drafters"]["ngram"]
        assert ngram["greedy_identical_to_target_only"]
        assert b2["drafters"]["oracle"]["greedy_identical_to_target_only"]  # handed target-only's outputs
        if waves > 1:  # the steady state ends where the queue runs dry: at most the whole run's tokens and time
            assert 0 < b2["target_only_steady_tok_s"] and "steady_speedup_vs_target_only" in ngram
            # whole runs in turn, two rounds: the pooled speedup lies between the two rounds' own
            assert b2["arms_in_turn"] and b2["rounds"] == 2 and len(ngram["speedup_by_round"]) == 2
            assert min(ngram["speedup_by_round"]) - 1e-9 <= ngram["speedup_vs_target_only"] \
                <= max(ngram["speedup_by_round"]) + 1e-9
        else:  # closed batches: one arm after another, once
            assert not b2["arms_in_turn"] and "speedup_by_round" not in ngram


def test_bench_decode_at_batch_1_runs_the_arms_in_turn_on_every_prompt(tiny_target_dir):
    from dspark.bench.decode import BASE, _rotated

    # the order turns prompt by prompt; the oracle replays target-only's output, so it never goes first
    assert _rotated([BASE, "ngram", "oracle"], 1) == ["ngram", BASE, "oracle"]
    assert _rotated([BASE, "ngram", "oracle"], 2) == [BASE, "ngram", "oracle"]
    args = ["bench", "decode", "--target", str(tiny_target_dir), "--batch-sizes", "1", "--num-prompts", "3",
            "--rounds", "2", "--max-new-tokens", "6", "--num-draft-tokens", "3", "--scheduler", "greedy",
            "--hf-dtypes", "", "--drafters", "ngram,oracle"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    b1 = json.loads(res.stdout.strip().splitlines()[-1])["batch1"]
    assert b1["arms_in_turn"] and b1["rounds"] == 2 and b1["num_prompts"] == 3
    for name, arm in b1["drafters"].items():
        assert arm["greedy_identical_to_target_only"], name
        q = arm["speedup_by_prompt"]
        assert 0 < q["min"] <= q["p25"] <= q["p50"] <= q["p75"] <= q["max"]
    # the oracle drafts target-only's own output, so all of it is accepted: 6 tokens are the prefill's, one round
    # of 3 + 1 and one of the last token, τ = (4 + 1) / 2
    assert b1["drafters"]["oracle"]["tau"] == 2.5


def test_bench_decode_runs_a_dspark_checkpoint_with_and_without_its_sts_side_by_side(tiny_target_dir, tiny_target,
                                                                                   tmp_path):
    from dspark.models.drafters.dspark.config import DSparkConfig
    from dspark.models.drafters.dspark.model import DSparkModel
    from tests.tiny_drafters import NUM_DRAFT_VOCAB, draft_vocab

    cfg = DSparkConfig.from_target(tiny_target.model.config, NUM_DRAFT_VOCAB, intermediate_size=96, block_size=4,
                                   sts_temperatures=[0.5, 1.0, 2.0, 4.0])
    DSparkModel(cfg, draft_vocab(tiny_target.model.config.vocab_size)).save_pretrained(tmp_path / "ckpt")
    args = ["bench", "decode", "--checkpoint", f"dspark={tmp_path / 'ckpt'}", "--target", str(tiny_target_dir),
            "--batch-sizes", "1", "--num-prompts", "1", "--max-new-tokens", "8", "--num-draft-tokens", "4",
            "--scheduler", "greedy", "--no-draft-gate", "--hf-dtypes", ""]
    res = runner.invoke(app, [*args, "--drafters", "dspark,dspark-nosts"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    arms = out["batch1"]["drafters"]
    assert set(arms) == {"dspark", "dspark-nosts"} and out["draft_gate"] is False
    assert all(a["greedy_identical_to_target_only"] and a["scheduler"] == "greedy" for a in arms.values())
    res = runner.invoke(app, [*args, "--drafters", "ngram-nosts"])
    assert res.exit_code == 2 and "no STS temperatures to drop" in res.output
