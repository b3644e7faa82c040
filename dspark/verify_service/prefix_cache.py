"""Automatic prefix caching: the K/V of prompt blocks seen before, copied into a new request's slot
instead of being computed again.

Prefill is compute-bound (~1k tokens/s for SmolLM2 in fp32 on a 2-core CPU), so a request whose prompt
starts like an earlier one (the chat template's system turn, a shared instruction, a repeated or
multi-turn conversation) pays only for what is new. Prompts are cut in blocks of BLOCK tokens; a block is
known by a hash chained over every token up to its end, so a hit means the whole prefix is the same, and
a prefix's K/V depend on nothing after it (causal attention). At least the prompt's last token is always
computed: its logits give the first output token.

Blocks are copies (K, V of every layer; the drafter's tapped features when it takes them), kept under a
byte budget, least recently used out first; the serving slots are never shared, so freeing, moving or
rolling back a slot needs no bookkeeping here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from dspark.models.target.kv_cache import KVCachePool

BLOCK = 16  # tokens per cached block


@dataclass
class _Block:
    k: torch.Tensor  # (layers, BLOCK, kv_heads, head_dim)
    v: torch.Tensor
    feats: torch.Tensor | None  # (BLOCK, taps * D): the drafter's context features, if it takes them
    tokens: tuple[int, ...]  # checked on a hit: a hash collision must never pass for a match

    @property
    def num_bytes(self) -> int:
        n = self.k.numel() * self.k.element_size() * 2
        return n + (self.feats.numel() * self.feats.element_size() if self.feats is not None else 0)


class PrefixCache:
    """Prompt-prefix K/V blocks, LRU under `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self.num_hit_tokens = 0  # prompt tokens served from here, for the stats
        self.num_prompt_tokens = 0

    @staticmethod
    def _hashes(prompt: list[int], num_blocks: int) -> list[int]:
        out, h = [], 0
        for b in range(num_blocks):
            h = hash((h, tuple(prompt[b * BLOCK:(b + 1) * BLOCK])))
            out.append(h)
        return out

    def match(self, prompt: list[int], need_feats: bool = False) -> list[_Block]:
        """The cached blocks of the longest known prefix, leaving at least the last token to compute; with
        `need_feats` (the drafter takes features) only blocks that kept them (a prompt admitted while the
        engine forwent features was stored without)."""
        blocks = []
        for b, h in enumerate(self._hashes(prompt, (len(prompt) - 1) // BLOCK)):
            block = self._blocks.get(h)
            if (block is None or block.tokens != tuple(prompt[b * BLOCK:(b + 1) * BLOCK])
                    or (need_feats and block.feats is None)):
                break
            self._blocks.move_to_end(h)
            blocks.append(block)
        self.num_prompt_tokens += len(prompt)
        self.num_hit_tokens += len(blocks) * BLOCK
        return blocks

    @staticmethod
    def load(blocks: list[_Block], cache: KVCachePool, slot: int) -> torch.Tensor | None:
        """Copy the blocks into positions 0.. of `slot`; returns their drafter features (T, F), or None unless
        every block kept them."""
        for b, block in enumerate(blocks):
            lo = b * BLOCK
            for layer in range(len(cache.k)):
                cache.k[layer][slot, lo:lo + BLOCK].copy_(block.k[layer])
                cache.v[layer][slot, lo:lo + BLOCK].copy_(block.v[layer])
        if not blocks or any(block.feats is None for block in blocks):  # a context with a hole is no context
            return None
        return torch.cat([block.feats for block in blocks])

    def store(self, prompt: list[int], cache: KVCachePool, slot: int, feats: torch.Tensor | None) -> None:
        """Keep the prompt's full blocks (its K/V now in `slot`; `feats` (len(prompt), F) or None)."""
        if self.max_bytes <= 0:
            return
        for b, h in enumerate(self._hashes(prompt, len(prompt) // BLOCK)):
            lo = b * BLOCK
            if h in self._blocks:
                self._blocks.move_to_end(h)
                kept = self._blocks[h]
                if kept.feats is None and feats is not None:  # stored while features were forgone: add them
                    kept.feats = feats[lo:lo + BLOCK].clone()
                    self.num_bytes += kept.feats.numel() * kept.feats.element_size()
                    self._evict()
                continue
            block = _Block(torch.stack([k[slot, lo:lo + BLOCK] for k in cache.k]),
                           torch.stack([v[slot, lo:lo + BLOCK] for v in cache.v]),
                           feats[lo:lo + BLOCK].clone() if feats is not None else None,
                           tuple(prompt[lo:lo + BLOCK]))
            if block.num_bytes > self.max_bytes:
                return
            self._blocks[h] = block
            self.num_bytes += block.num_bytes
            self._evict()

    def _evict(self) -> None:
        """The least recently used blocks out, down to `max_bytes`."""
        while self.num_bytes > self.max_bytes:
            _, old = self._blocks.popitem(last=False)
            self.num_bytes -= old.num_bytes

    def clear(self) -> None:
        self._blocks.clear()
        self.num_bytes = 0
