"""Online target features (`train.features: online`): the same tensors the target cache stores, computed per
batch, and training from them needs no cache on disk."""

from __future__ import annotations

import random

import torch

from dspark.models.drafters.dspark.config import default_target_layers
from dspark.training.batches import SequencePool, make_batch
from dspark.training.online_pool import OnlinePool
from dspark.training.target_cache import CachedShard, build_cache


def _records(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))],
             "response_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 30))]} for _ in range(n)]


def test_online_features_equal_the_cached_ones(tiny_target, tmp_path):
    records = _records(12, tiny_target.model.config.vocab_size)
    layers = default_target_layers(tiny_target.model.config.num_hidden_layers)
    build_cache(tiny_target, records, layers, tmp_path / "cache", shard_size=32, max_len=32)
    cached = SequencePool([CachedShard.load(p) for p in sorted((tmp_path / "cache").glob("cache-*.safetensors"))])
    online = OnlinePool(records, tiny_target, layers, max_len=32)
    assert len(online) == len(cached) == 12
    drawn = online.sample(random.Random(3), 5, step=0)
    assert len(set(drawn)) == 5 and online.num_tokens == sum(len(online.seqs[i][0]) for i in drawn)
    for idx in drawn:
        got, want = online.get(idx), cached.get(idx)
        assert torch.equal(got[0], want[0]) and got[4] == want[4]  # tokens, prompt length
        for g, w in zip(got[1:4], want[1:4]):  # features, final hidden, logsumexp
            assert g.shape == w.shape and g.dtype == w.dtype
            # a value stored in bf16 may land one rounding step apart when the fp32 it came from differs in its
            # last bits (the cache runs 32 sequences per forward, the online pool fewer: on an AMX Xeon the GEMM
            # sums in another order by batch); one bf16 step is 2**-7 relative
            rtol = 2**-7 if w.dtype == torch.bfloat16 else 1e-3
            torch.testing.assert_close(g.float(), w.float(), atol=1e-4, rtol=rtol)
    # a batch draws from the sequences just computed; the next draw replaces them
    batch = make_batch(online, drawn, num_anchors=3, block_size=4, gen=torch.Generator().manual_seed(0))
    assert batch.features.shape[0] == 5 and bool(batch.is_anchor_valid.any())
    again = online.sample(random.Random(4), 5, step=1)
    assert all(online.get(i)[0].numel() for i in again) and online.forward_s > 0
    # the same RNG state draws the same sequences (a resumed run sees the same batches)
    assert OnlinePool(records, tiny_target, layers, 32).sample(random.Random(3), 5, 0) == drawn
