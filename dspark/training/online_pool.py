"""Online target features: each training batch's sequences run through the target when the batch is drawn.

The alternative to the target cache (`target_cache.py`): nothing is stored, so a fresh machine trains from
the committed token ids alone, with no multi-GB cache to build or keep. Each step pays one batched prefill
of its sequences (the same `cache_sequences` forward the cache is built with, so the features are the same
up to kernel rounding); `forward_s` is that time, to set against the cache's build time and disk reads.
Which sequences a step draws depends only on the trainer's RNG, so a resumed run draws the same batches.
"""

from __future__ import annotations

import random
import time

import torch

from dspark.models.target.loader import TargetModel
from dspark.training.target_cache import CachedShard, cache_sequences


class OnlinePool:
    def __init__(self, records: list[dict], target: TargetModel, layers: list[int], max_len: int,
                 batch_tokens: int = 4096) -> None:
        if not records:
            raise ValueError("no training records")
        self.seqs = [((r["prompt_ids"] + r["response_ids"])[:max_len], len(r["prompt_ids"])) for r in records]
        self.target, self.layers, self.batch_tokens = target, layers, batch_tokens
        self._drawn: dict[int, tuple[CachedShard, int]] = {}
        self.forward_s = 0.0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def sample(self, rng: random.Random, n: int, step: int) -> list[int]:
        """`n` distinct sequences, their features computed now (the previous batch's are dropped)."""
        indices = rng.sample(range(len(self.seqs)), min(n, len(self.seqs)))
        seqs = [self.seqs[i] for i in indices]
        t0 = time.perf_counter()
        shard = CachedShard(**cache_sequences(self.target, seqs, self.layers, self.batch_tokens, len(seqs)))
        self.forward_s += time.perf_counter() - t0
        self.num_tokens += sum(len(s) for s, _ in seqs)
        self._drawn = {idx: (shard, j) for j, idx in enumerate(indices)}
        return indices

    def get(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        shard, j = self._drawn[idx]
        return shard.sequence(j)
