"""Request lifecycle: stop conditions, validation, aborts, the async front, and the n-gram drafter."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from dspark.cluster.ingress.text_stream import TextStream
from dspark.config.engine import EngineConfig
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.ngram import NgramDrafter
from dspark.verify_service.async_engine import AsyncEngine
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import FinishReason, SamplingParams
from tests.test_engine_lossless import tiny_prompts


@pytest.fixture()
def engine(tiny_target):
    cfg = EngineConfig(target=str(tiny_target.path), drafter="ngram", scheduler="greedy",
                       max_num_seqs=4, max_model_len=256)
    return Engine(cfg, target=tiny_target)


def test_max_tokens_is_exact_even_when_drafts_would_overshoot(engine):
    prompt = [5, 6, 7, 8] * 6  # repetitive: the n-gram drafter proposes long blocks
    for n in (1, 2, 5, 13):
        (req,) = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
        assert len(req.output_ids) == n and req.finish_reason == FinishReason.LENGTH


def test_eos_stops_and_is_not_part_of_the_output(engine, tiny_target):
    eos = tiny_target.eos_token_ids[0]
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)
    free = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    with_eos = [i for i, r in enumerate(free) if eos in r.output_ids]
    assert with_eos, "the tiny model should emit EOS somewhere in 32 prompts"
    i = with_eos[0]
    (req,) = engine.generate([prompts[i]], SamplingParams(max_tokens=40))
    cut = free[i].output_ids.index(eos)
    assert req.output_ids == free[i].output_ids[:cut] and req.finish_reason == FinishReason.STOP


def test_stop_string_ends_the_request(engine, tiny_target):
    prompt = tiny_prompts(tiny_target.model.config.vocab_size)[1]
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))
    text = tiny_target.tokenizer.decode(free.output_ids, skip_special_tokens=True)
    stop = text.split()[3]
    (req,) = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))
    assert req.finish_reason == FinishReason.STOP
    cut_text = tiny_target.tokenizer.decode(req.output_ids, skip_special_tokens=True)[:req.stop_text_len]
    assert stop not in cut_text and text.startswith(cut_text)


def test_invalid_requests_are_refused_with_a_reason(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([5] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([5, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_abort_frees_the_slot(engine):
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.runner.cache.num_active == 1
    engine.abort(rid)
    outs = engine.step()
    assert any(o.request_id == rid and o.finish_reason == FinishReason.ABORT for o in outs)
    assert engine.runner.cache.num_active == 0 and not engine.has_unfinished()


def test_async_engine_streams_concurrent_requests_and_matches_the_sync_engine(engine, tiny_target):
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:5]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = [r.output_ids for r in engine.generate(prompts, params)]
    front = AsyncEngine(engine)

    async def one(p: list[int]) -> tuple[list[int], int]:
        toks, n = [], 0
        async for out in front.generate(p, params):
            toks += out.new_token_ids
            n += 1
        return toks, n

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        got = asyncio.run(main())
        deadline = time.monotonic() + 5.0
        while front.num_trims == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        front.shutdown()
    assert [t for t, _ in got] == expected
    assert all(n > 1 for _, n in got)  # streamed over several steps
    assert front.num_trims == 1  # idle after the work: the freed heap went back, once per idle spell


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_goes_back_to_the_os():
    import ctypes

    import psutil

    from dspark.verify_service.heap import release_free_memory

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(50_000)]  # ~200 MB in small heap chunks, touched
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    for b in blocks:
        libc.free(b)
    before = psutil.Process().memory_info().rss
    assert release_free_memory()
    assert psutil.Process().memory_info().rss < before - 100 * 2**20


@pytest.mark.parametrize("merge", [True, False])
def test_a_consumer_that_falls_behind_gets_the_missed_steps_as_one_output(tiny_target, merge):
    """The engine keeps stepping while a caller is busy; what queued meanwhile arrives merged, in order
    (`merge_stream_outputs`; off: one output per step, as before)."""
    engine = Engine(EngineConfig(target=str(tiny_target.path), drafter="ngram", scheduler="fixed",
                                 draft_gate=False, max_num_seqs=4, max_model_len=256), target=tiny_target)
    prompt = tiny_prompts(tiny_target.model.config.vocab_size)[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)
    (ref,) = engine.generate([prompt], params)
    engine.config.merge_stream_outputs = merge
    front = AsyncEngine(engine)

    async def slow() -> list:
        outs = []
        async for out in front.generate(prompt, params):
            outs.append(out)
            if len(outs) == 1:
                await asyncio.sleep(0.2)  # busy once: the engine runs ahead
        return outs

    try:
        outs = asyncio.run(slow())
    finally:
        front.shutdown()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == ref.output_ids == outs[-1].output_ids
    assert [lp.token_id for o in outs for lp in o.new_logprobs] == tokens  # log-probs stay aligned
    if merge:
        assert len(outs) < ref.num_steps + 1  # fewer messages than steps: the backlog was merged
    else:
        assert len(outs) == ref.num_steps + 1  # the prefill's token, then one output per step
    assert outs[-1].is_finished and not any(o.is_finished for o in outs[:-1])


def test_a_stream_interval_holds_a_streams_steps_and_sends_them_merged(tiny_target):
    """`stream_interval_ms`: the first token (TTFT) and the end go out at once, the steps between at most once
    an interval, merged; the tokens and log-probs are the same. A stream whose caller leaves holds nothing."""
    engine = Engine(EngineConfig(target=str(tiny_target.path), drafter="ngram", scheduler="fixed",
                                 draft_gate=False, max_num_seqs=4, max_model_len=256), target=tiny_target)
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:2]
    params = SamplingParams(max_tokens=60, ignore_eos=True, logprobs=0)
    ref = engine.generate(prompts, params)
    engine.config.stream_interval_ms = 30.0
    front = AsyncEngine(engine)

    async def stream(prompt: list[int], leave_after: int | None = None) -> list:
        outs = []
        async for out in front.generate(prompt, params):
            outs.append((time.monotonic(), out))
            if len(outs) == leave_after:
                break
        return outs

    async def both() -> list:
        return await asyncio.gather(stream(prompts[0]), stream(prompts[1]))

    try:
        runs = asyncio.run(both())
        left = asyncio.run(stream(prompts[0], leave_after=1))
        deadline = time.monotonic() + 10
        while (front._held or front._sent_at) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not front._held and not front._sent_at  # the aborted stream left nothing behind
    finally:
        front.shutdown()
    assert len(left) == 1
    for r, timed in zip(ref, runs, strict=True):
        outs = [o for _, o in timed]
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == r.output_ids == outs[-1].output_ids
        assert [lp.token_id for o in outs for lp in o.new_logprobs] == tokens
        assert outs[0].new_token_ids == r.output_ids[:1]  # the prefill's token is not held
        assert outs[-1].is_finished and not any(o.is_finished for o in outs[:-1])
        assert len(outs) < r.num_steps + 1  # fewer messages than steps
        # ... and the steps are still counted as steps: the engine's count (the prefill too) rides in the merged
        # messages, and the API's speculation stats (τ, tokens per step) read it, not the messages
        assert outs[-1].num_steps == r.num_steps + 1
        text = TextStream(engine.tokenizer, [])
        for o in outs:
            text.add(o)
        assert text.spec_stats().num_steps == r.num_steps + 1
        span = timed[-1][0] - timed[0][0]
        assert len(outs) <= 2 + span / 0.030 + 1  # at most one an interval between the first and the end


def test_ngram_drafter_copies_what_followed_the_latest_match():
    d = NgramDrafter(max_ngram=3)
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    out = d.propose([DraftRequest("a", seq, 0.0)], 4)
    assert out.tokens == [[4, 5, 9, 9]] and out.probs is None and out.confidences is None
    assert d.propose([DraftRequest("b", [7, 8, 6], 0.0)], 4).tokens == [[]]


def test_a_serving_engine_keeps_a_bounded_window_of_step_records(tiny_target):
    cfg = EngineConfig(target=str(tiny_target.path), drafter="ngram", scheduler="fixed", max_num_seqs=4,
                       max_model_len=256, max_step_stats=5)
    engine = Engine(cfg, target=tiny_target)
    engine.generate(tiny_prompts(tiny_target.model.config.vocab_size)[:2],
                    SamplingParams(max_tokens=30, ignore_eos=True))
    assert engine.num_steps >= 15  # at least one step per token beyond the first, for 30 tokens
    assert 5 <= len(engine.stats) < 10  # trimmed back to the latest 5 whenever it reached 10
    assert engine.stats[-1].end_s >= engine.stats[0].end_s


def test_serve_configs_bound_the_step_records():
    from dspark.config.serve import SERVER_STEP_STATS, ServeAppConfig

    assert ServeAppConfig().engine_config().max_step_stats == SERVER_STEP_STATS
    assert EngineConfig().max_step_stats is None  # benchmarks read every step
