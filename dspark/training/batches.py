"""Training batches from the target cache: sequences, random anchors, and p_t over the draft vocab."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dspark.training.target_cache import CachedShard


class SequenceSource(Protocol):
    """Where training sequences come from: all resident (SequencePool), a window over cache shards
    (ShardWindowPool) or computed by the target per batch (OnlinePool)."""

    def __len__(self) -> int: ...

    def sample(self, rng: random.Random, n: int, step: int) -> list[int]: ...

    def get(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]: ...


@dataclass
class TrainBatch:
    features: torch.Tensor  # (B, L, taps*D) fp32
    token_ids: torch.Tensor  # (B, L)
    seq_lens: torch.Tensor  # (B,)
    anchors: torch.Tensor  # (B, M) anchor positions
    is_anchor_valid: torch.Tensor  # (B, M)
    final_hidden: torch.Tensor  # (B, L, D) fp32 target final hidden (pre-norm)
    lse: torch.Tensor  # (B, L) full-vocab logsumexp


class SequencePool:
    """All cached sequences of some shards, addressable by index."""

    def __init__(self, shards: list[CachedShard]) -> None:
        self.items: list[tuple[CachedShard, int]] = [(s, i) for s in shards for i in range(len(s.prompt_lens))]

    def __len__(self) -> int:
        return len(self.items)

    def sample(self, rng: random.Random, n: int, step: int) -> list[int]:
        """`n` distinct sequences for a batch (every sequence is resident; `step` is not needed)."""
        return rng.sample(range(len(self.items)), min(n, len(self.items)))

    def get(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        shard, i = self.items[idx]
        return shard.sequence(i)


def make_batch(pool: SequenceSource, indices: list[int], num_anchors: int, block_size: int,
               gen: torch.Generator) -> TrainBatch:
    """Anchors are drawn uniformly from positions whose first prediction is a response token."""
    seqs = [pool.get(i) for i in indices]
    max_len = max(len(s[0]) for s in seqs)
    b = len(seqs)
    taps_d, d = seqs[0][1].shape[1], seqs[0][2].shape[1]
    feats = torch.zeros(b, max_len, taps_d)
    toks = torch.zeros(b, max_len, dtype=torch.long)
    final = torch.zeros(b, max_len, d)
    lse = torch.zeros(b, max_len)
    lens = torch.zeros(b, dtype=torch.long)
    anchors = torch.zeros(b, num_anchors, dtype=torch.long)
    valid = torch.zeros(b, num_anchors, dtype=torch.bool)
    for j, (t, f, h, ls, plen) in enumerate(seqs):
        n = len(t)
        feats[j, :n], toks[j, :n], final[j, :n], lse[j, :n], lens[j] = f.float(), t, h, ls, n
        lo, hi = max(plen - 1, 1), n - 2  # anchor a predicts a+1 ..; needs context (a ≥ 1) and a+1 < n
        if hi >= lo:
            anchors[j] = torch.randint(lo, hi + 1, (num_anchors,), generator=gen)
            valid[j] = True
    return TrainBatch(feats, toks, lens, anchors, valid, final, lse)


def target_probs_over_draft_vocab(batch: TrainBatch, block_size: int, final_norm_weight: torch.Tensor,
                                  eps: float, draft_head: torch.Tensor) -> torch.Tensor:
    """p_t(v) for v in the draft vocab at block positions: (B, M, γ, N).

    Position k (1-based) of the block at anchor a predicts token a+k, i.e. the target's output at a+k-1.
    """
    b, length, d = batch.final_hidden.shape
    src = (batch.anchors[:, :, None] + torch.arange(block_size)).clamp(max=length - 1)  # (B, M, γ)
    flat = src.reshape(b, -1)
    h = batch.final_hidden.gather(1, flat[..., None].expand(-1, -1, d))  # (B, M·γ, D)
    lse = batch.lse.gather(1, flat)  # (B, M·γ)
    logits = F.rms_norm(h, (d,), final_norm_weight, eps) @ draft_head.t()  # (B, M·γ, N)
    probs = torch.exp(logits - lse[..., None])
    return probs.reshape(*src.shape, -1)


def select_features(batch: TrainBatch, cache_layers: list[int], final_layer: int, layers: list[int]) -> torch.Tensor:
    """The features of `layers` (HF hidden_states indices), concatenated: (B, L, len(layers)*D).

    The cache holds the taps `cache_layers` in `batch.features` and the last layer (`final_layer`) in
    `batch.final_hidden`, so a drafter conditioned on either trains from the same cache.
    """
    if list(layers) == list(cache_layers):
        return batch.features
    d = batch.final_hidden.shape[-1]
    columns = []
    for layer in layers:
        if layer in cache_layers:
            i = cache_layers.index(layer)
            columns.append(batch.features[..., i * d:(i + 1) * d])
        elif layer == final_layer:
            columns.append(batch.final_hidden)
        else:
            raise ValueError(f"target layer {layer} is not in the cache (taps {cache_layers}, final {final_layer})")
    return torch.cat(columns, dim=-1)
