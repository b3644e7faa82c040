"""Automatic prefix caching: a prompt that starts like an earlier one reuses its K/V blocks (and the drafter's
features), decodes exactly as without the cache, and the cache stays within its byte budget."""

from __future__ import annotations

import torch

from dspark.config.engine import EngineConfig
from dspark.models.drafters.dspark.drafter import DSparkDrafter
from dspark.spec.sps import SPSTable
from dspark.verify_service.engine import Engine
from dspark.verify_service.prefix_cache import BLOCK, PrefixCache
from dspark.verify_service.request import SamplingParams
from tests.test_dspark_model import GAMMA, make_model


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(4, vocab, (2 * BLOCK + 5,), generator=gen).tolist()  # a shared "system turn"
    return [system + torch.randint(4, vocab, (n,), generator=gen).tolist() for n in (3, 20, 41, 9)]


def _engine(tiny_target, prefix_cache_mb: int, **kw) -> Engine:  # noqa: ANN001
    cfg = EngineConfig(target=str(tiny_target.path), max_num_seqs=4, max_model_len=256,
                       prefix_cache_mb=prefix_cache_mb, **kw)
    return Engine(cfg, target=tiny_target)


def test_repeated_and_shared_prefixes_come_from_the_cache_and_decode_the_same(tiny_target) -> None:
    prompts = _prompts(tiny_target.model.config.vocab_size)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = _engine(tiny_target, 0, drafter="none", num_draft_tokens=0)
    expected = [r.output_ids for r in plain.generate(prompts, params)]
    assert plain.prefix_cache is None

    cached = _engine(tiny_target, 16, drafter="none", num_draft_tokens=0)
    first = [r.output_ids for r in cached.generate(prompts[:1], params)]  # stores the shared blocks
    hits_before = cached.prefix_cache.num_hit_tokens
    again = [r.output_ids for r in cached.generate(prompts, params)]  # the shared part and prompt 0 whole
    assert first == expected[:1] and again == expected
    shared_blocks = (2 * BLOCK + 5) // BLOCK
    # prompt 0 again: every full block short of its last token; the others: the shared system blocks
    min_hits = ((len(prompts[0]) - 1) // BLOCK) + 3 * shared_blocks
    assert cached.prefix_cache.num_hit_tokens - hits_before >= min_hits * BLOCK


def test_dspark_drafter_gets_the_features_it_would_have_computed(tiny_target, tmp_path) -> None:
    sps_path = tmp_path / "sps.json"
    SPSTable.from_sps({1: 100.0, 8: 80.0, 64: 20.0}).save(sps_path)
    prompts = _prompts(tiny_target.model.config.vocab_size)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    observed: dict[str, list[torch.Tensor]] = {}

    class Recording(DSparkDrafter):
        def observe(self, request_id: str, feats: torch.Tensor) -> None:
            observed.setdefault(request_id, []).append(feats.clone())
            super().observe(request_id, feats)

    model = make_model(tiny_target)
    common = dict(target=str(tiny_target.path), max_num_seqs=4, max_model_len=256, drafter="ngram",
                  scheduler="greedy", num_draft_tokens=GAMMA, sps_profile=str(sps_path), draft_gate=False)
    runs = {}
    for mb in (0, 16):
        engine = Engine(EngineConfig(**common, prefix_cache_mb=mb), target=tiny_target,
                        drafter=Recording(model, tiny_target))
        engine.generate(prompts[:1], params)
        observed.clear()
        reqs = engine.generate(prompts, params)
        runs[mb] = ([r.output_ids for r in reqs], [observed[r.request_id][0] for r in reqs],
                    sum(r.num_verified for r in reqs))
    assert runs[16][0] == runs[0][0]  # lossless either way
    for with_cache, without in zip(runs[16][1], runs[0][1]):
        assert with_cache.shape == without.shape  # every prompt position, cached part first
        torch.testing.assert_close(with_cache, without, atol=1e-5, rtol=1e-5)
    assert runs[16][2] > 0


def test_the_cache_stays_within_its_budget_least_recently_used_out_first(tiny_target) -> None:
    engine = _engine(tiny_target, 0, drafter="none", num_draft_tokens=0)
    cache = engine.runner.cache
    slot = cache.allocate()
    vocab = tiny_target.model.config.vocab_size
    prompts = [[4 + (i * 7 + j) % (vocab - 4) for j in range(3 * BLOCK)] for i in range(6)]
    per_block = 2 * sum(k[0, :BLOCK].numel() * k.element_size() for k in cache.k)
    store = PrefixCache(max_bytes=5 * per_block)
    for p in prompts:
        store.store(p, cache, slot, None)
        assert store.num_bytes <= store.max_bytes
    assert len(store.match(prompts[-1] + [5])) == 3  # the newest prompt is whole
    assert store.match(prompts[0] + [5]) == []  # the oldest went first


def test_blocks_kept_without_features_serve_no_drafter_that_needs_them_until_stored_with_them(tiny_target) -> None:
    """A prompt admitted while the engine forwent the drafter's features is kept without them: a drafter that
    takes features must not get a context with a hole, so those blocks match only for engines without one,
    and the first store that has the features adds them."""
    engine = _engine(tiny_target, 0, drafter="none", num_draft_tokens=0)
    cache = engine.runner.cache
    slot = cache.allocate()
    vocab = tiny_target.model.config.vocab_size
    prompt = [4 + (j * 5) % (vocab - 4) for j in range(3 * BLOCK)]
    store = PrefixCache(max_bytes=1 << 24)
    store.store(prompt, cache, slot, None)
    assert len(store.match(prompt + [5])) == 3 and store.match(prompt + [5], need_feats=True) == []
    bytes_before = store.num_bytes
    feats = torch.randn(len(prompt), 6)
    store.store(prompt, cache, slot, feats)
    blocks = store.match(prompt + [5], need_feats=True)
    assert len(blocks) == 3 and store.num_bytes == bytes_before + feats.numel() * feats.element_size()
    torch.testing.assert_close(PrefixCache.load(blocks, cache, slot), feats)
    longer = prompt + [4 + (j * 3) % (vocab - 4) for j in range(BLOCK)]  # one more block, kept without features
    store.store(longer, cache, slot, None)
    mixed = store.match(longer + [5])
    assert len(mixed) == 4 and PrefixCache.load(mixed, cache, slot) is None  # a context with a hole is none
    assert len(store.match(longer + [5], need_feats=True)) == 3
