"""Slot-based KV cache: one preallocated slot per running request, rollback by length."""

from __future__ import annotations

import torch

from dspark.kernels import huge_pages


class SlotPool:
    """Request slots 0..num_active-1, kept dense: freeing a slot moves the last active one into it. Subclasses
    say what a slot holds (`_clear`, `_move`)."""

    def __init__(self, max_num_seqs: int, max_model_len: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.lengths = [0] * max_num_seqs  # valid cached tokens per slot
        self.num_active = 0

    def allocate(self) -> int:
        if self.num_active >= self.max_num_seqs:
            raise RuntimeError("KV cache pool is full")
        slot = self.num_active
        self.num_active += 1
        self.lengths[slot] = 0
        self._clear(slot)
        return slot

    def free(self, slot: int) -> int | None:
        """Release a slot; the last active slot moves into it. Returns the moved slot's old index."""
        last = self.num_active - 1
        self.num_active -= 1
        if slot == last:
            self._clear(slot)
            return None
        self._move(last, slot)
        self.lengths[slot] = self.lengths[last]
        self._clear(last)
        return last

    def _clear(self, slot: int) -> None:
        """Forget what `slot` holds (a freshly allocated or vacated slot)."""

    def _move(self, src: int, dst: int) -> None:
        """Copy slot `src`'s contents (its first lengths[src] positions) into slot `dst`."""


class KVCachePool(SlotPool):
    """K/V tensors of shape (max_num_seqs, max_model_len, num_kv_heads, head_dim) per layer.

    Position-major within a slot, so writing T new tokens is one `index_copy_` of T contiguous rows
    into a (slots * positions, heads * head_dim) view (2 index tensors over a strided layout cost
    ~90 µs a write at 128 tokens); attention reads a transposed (heads, positions) view, as fast.

    Active requests occupy slots 0..num_active-1 (kept compact, so attention reads a view of the
    first rows, never a gather). Rolling back rejected draft tokens is just not advancing the
    length: their entries are overwritten by the next step's writes and masked out until then.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_num_seqs: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (max_num_seqs, max_model_len, num_kv_heads, head_dim)
        # zeros, not empty: masked keys still enter P@V, and 0 * NaN garbage would poison valid rows. On the CPU on
        # huge pages: attention streams each request's keys and values every step (kernels/huge_pages.py)
        if torch.device(device).type == "cpu":
            self.k = [huge_pages.zeros(shape, dtype) for _ in range(num_layers)]
            self.v = [huge_pages.zeros(shape, dtype) for _ in range(num_layers)]
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        super().__init__(max_num_seqs, max_model_len)

    def _move(self, src: int, dst: int) -> None:
        n = self.lengths[src]
        for k, v in zip(self.k, self.v):
            k[dst, :n].copy_(k[src, :n])
            v[dst, :n].copy_(v[src, :n])

    def rows(self, slot_idx: torch.Tensor, pos_idx: torch.Tensor) -> torch.Tensor:
        """(T,) row of each (slot, position) in the flattened (slots * positions) view, for `write`."""
        return slot_idx * self.max_model_len + pos_idx

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: (T, num_kv_heads, head_dim) for flattened tokens at `rows` (from `rows`)
        width = k.shape[1] * k.shape[2]
        self.k[layer].view(-1, width).index_copy_(0, rows, k.reshape(-1, width))
        self.v[layer].view(-1, width).index_copy_(0, rows, v.reshape(-1, width))

    def view(self, layer: int, num_seqs: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        # (num_seqs, num_kv_heads, num_keys, head_dim) views of the first slots
        return (self.k[layer][:num_seqs, :num_keys].transpose(1, 2),
                self.v[layer][:num_seqs, :num_keys].transpose(1, 2))
