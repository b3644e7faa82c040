"""The side-by-side helpers of the scripts under docs/results: variants timed in turns of alternating order
(`kernel_ab.turns_ms`), native builds of two sources loaded side by side (`kernel_ab.kernel_libraries`: the engine's
kernels and the suffix drafter's), a
change's four-engine A/B (`decode.change_ab`) and arms against target-only (`decode.run_at`, `decode.arms_vs_target`)
on a tiny target."""

from __future__ import annotations

import subprocess

import pytest
import torch

from dspark.bench.decode import BASE, _engine, arms_vs_target, change_ab, run_at
from dspark.bench.kernel_ab import kernel_libraries, turns_ms, use_library
from dspark.kernels import native, suffix_native
from dspark.models.drafters.suffix.index import RequestText, WalkParams


def test_turns_alternate_their_order_warm_up_untimed_and_repeat_for_min_s() -> None:
    calls: list[str] = []
    variants = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    med = turns_ms(variants, turns=3, warmup=1)
    # each turn: every variant warmed once then timed once; the order reversed every other turn
    assert calls == ["a", "a", "b", "b", "c", "c", "c", "c", "b", "b", "a", "a", "a", "a", "b", "b", "c", "c"]
    assert set(med) == {"a", "b", "c"} and all(v >= 0 for v in med.values())
    calls.clear()
    turns_ms({"a": variants["a"]}, turns=2, min_s=0.01)
    assert len(calls) > 2  # repeated within each turn until 10 ms had passed


@pytest.mark.skipif(not native.is_available(), reason="no C compiler on this machine")
@pytest.mark.skipif(subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode != 0,
                    reason="not a git checkout")
def test_two_builds_load_side_by_side_and_calls_go_to_the_one_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "library", native.library)  # use_library replaces them: restored after the test
    monkeypatch.setattr(native, "_required", native._required)
    libs = kernel_libraries("HEAD", {"tiles2": {"NATIVE_TR": "2"}})
    assert set(libs) == {"base", "head", "tiles2"} and len({id(lib) for lib in libs.values()}) == 3
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 48, generator=gen), torch.randn(5, 48, generator=gen)
    outs = {}
    for name in libs:
        use_library(libs, name)
        assert native.library() is libs[name]
        outs[name] = native.linear(x, native.pack(w), 64)
    assert torch.equal(outs["base"], outs["head"]) and torch.equal(outs["head"], outs["tiles2"])


def test_the_suffix_kernels_load_side_by_side_too_and_walks_go_to_the_one_in_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`module=suffix_native`: its C source at the base commit and this checkout's, and its `required()` (what the
    suffix index calls) switched with `library()`; a walk over a small text is the same on either build."""
    monkeypatch.setattr(suffix_native, "library", suffix_native.library)
    monkeypatch.setattr(suffix_native, "required", suffix_native.required)
    libs = kernel_libraries("HEAD", module=suffix_native)
    assert set(libs) == {"base", "head"} and libs["base"] is not libs["head"]
    text = RequestText()
    text.sync([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6])
    walks = {}
    for name in libs:
        use_library(libs, name, module=suffix_native)
        assert suffix_native.library() is libs[name] and suffix_native.required() is libs[name]
        walks[name] = text.walk(4, WalkParams(min_path_prob=0.0))
    assert walks["base"].tokens == walks["head"].tokens == [7, 8, 9, 5]


def test_a_change_ab_reports_both_sides_ratios_and_agreement(tiny_target) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (12,), generator=gen).tolist() for _ in range(4)]
    max_len = 12 + 8 + 10

    def engines(bs: int) -> dict:
        return {BASE: _engine(BASE, tiny_target, bs, max_len, "greedy", 3, None, True, {}),
                "target-new": _engine(BASE, tiny_target, bs, max_len, "greedy", 3, None, True, {}),
                "hybrid-old": _engine("ngram", tiny_target, bs, max_len, "greedy", 3, None, True, {}),
                "hybrid-new": _engine("ngram", tiny_target, bs, max_len, "greedy", 3, None, True, {})}

    for bs in (1, 2):
        res = change_ab(engines(bs), "old", "new", prompts, bs, 8, rounds=2, num_batch1=2, waves=2)
        tok = res["tok_s"]
        assert set(tok) == {BASE, "target-new", "hybrid-old", "hybrid-new"} and res["greedy_identical_across_arms"]
        assert res["hybrid_over_target"]["old"] == pytest.approx(tok["hybrid-old"] / tok[BASE], rel=0.02)
        assert res["new_over_old"]["target"] == pytest.approx(tok["target-new"] / tok[BASE], rel=0.02)
        if bs == 1:
            assert "per_round_tok_s" not in res
        else:
            assert all(len(r) == 2 for r in res["per_round_tok_s"].values())
            assert set(res["steady_hybrid_over_target"]) == {"old", "new"}


def test_arms_against_target_only_per_eval_set_at_batch_1_and_per_round_above(tiny_target) -> None:  # noqa: ANN001
    """`run_at` + `arms_vs_target`, as the side-by-side scripts print an arm against target-only: at batch 1 a
    speedup per eval set of the labelled prompts (each set's time summed), above it each round's and the steady
    state's; greedy output checked against target-only's."""
    gen = torch.Generator().manual_seed(1)
    labelled = [(name, torch.randint(3, 50, (12,), generator=gen).tolist()) for name in ("gsm8k", "mbpp") * 2]
    prompts = [p for _, p in labelled]
    for bs in (1, 2):
        engines = {BASE: _engine(BASE, tiny_target, bs, 30, "greedy", 3, None, True, {}),
                   "ngram": _engine("ngram", tiny_target, bs, 30, "greedy", 3, None, True, {})}
        ran, by_round = run_at(engines, prompts, bs, 8, rounds=2, num_batch1=4, waves=2)
        res = arms_vs_target(ran, by_round, labelled)
        arm = res["ngram"]
        assert res["target_only_tok_s"] == round(ran[BASE].tok_s, 1) and arm["greedy_identical"]
        assert arm["speedup"] == pytest.approx(ran["ngram"].tok_s / ran[BASE].tok_s, abs=1e-3)
        if bs == 1:
            assert by_round is None and set(arm["by_domain"]) == {"gsm8k", "mbpp"} and "by_round" not in arm
            base_s = sum(s for (d, _), s in zip(labelled, ran[BASE].group_s) if d == "mbpp")
            arm_s = sum(s for (d, _), s in zip(labelled, ran["ngram"].group_s) if d == "mbpp")
            assert arm["by_domain"]["mbpp"] == pytest.approx(base_s / arm_s, abs=1e-3)
        else:
            assert len(arm["by_round"]) == 2 and "by_domain" not in arm
