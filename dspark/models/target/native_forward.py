"""The runner's fp32 forwards through native kernels (`native.py`), same inputs and outputs as
`TargetRunner.forward`.

- `forward_fused`: a few tokens (the row counts where the measured plan picked the native GEMM): the whole
  decoder stack in one native call. At batch 1 PyTorch's ~60 small ops per layer cost about as
  much as the weight reads themselves.
- `forward_native_attention`: any batch; PyTorch GEMMs (the plan's kernels) and elementwise ops, attention
  in native code. Each token attends to its own slot's keys up to its position, so no padded query view
  and no mask are built.

Both write the step's K/V into the slot cache before attention, as the PyTorch path does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dspark.kernels import native
from dspark.kernels.gemm_plan import GemmPlan
from dspark.kernels.native import FusedDecoder
from dspark.models.target.family import LayerWeights
from dspark.models.target.kv_cache import KVCachePool
from dspark.models.target.layer import (
    ForwardOutput,
    SeqChunk,
    add_rms_norm,
    attention_out_and_mlp_parts,
    head_norms,
    rms_norm,
)


class TargetRunner(Protocol):
    """What these forwards read of the runner (`runner.TargetRunner`, which imports this module)."""

    cache: KVCachePool
    fused: FusedDecoder | None
    gemm_plan: GemmPlan
    layers: list[LayerWeights]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    activation: str

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor: ...

    def logits(self, rows: torch.Tensor) -> torch.Tensor: ...

    def _rotary_tables(self, x: torch.Tensor, positions: torch.Tensor) -> dict[Any, tuple[torch.Tensor, ...]]: ...


@dataclass
class _Flat:
    """A step's tokens flattened in chunk order, and where each one reads and writes the cache."""

    ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    cache_row: torch.Tensor  # (T,) flat (slot * max_len + position) row its K/V goes to
    key_row: torch.Tensor  # (T,) flat row of its slot's first key
    num_keys: torch.Tensor  # (T,) keys it attends to: position + 1
    max_keys: int
    logit_rows: list[int]


def _flatten(chunks: list[SeqChunk], max_len: int) -> _Flat:
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    for c in chunks:
        n = len(c.token_ids)
        logit_rows += range(len(token_ids) + n - c.num_logits, len(token_ids) + n)
        token_ids += c.token_ids
        positions += range(c.start_pos, c.start_pos + n)
        slots += [c.slot] * n
    pos_idx = torch.tensor(positions)
    key_row = torch.tensor(slots) * max_len
    return _Flat(torch.tensor(token_ids), pos_idx, key_row + pos_idx, key_row, pos_idx + 1, max(positions) + 1,
                 logit_rows)


def _logits(runner: TargetRunner, x: torch.Tensor, flat: _Flat, hidden: dict[int, torch.Tensor]) -> ForwardOutput:
    rows = x[torch.tensor(flat.logit_rows)] if len(flat.logit_rows) < x.shape[0] else x
    return ForwardOutput(logits=runner.logits(rows), hidden_states=hidden)


def _rotary(runner: TargetRunner, x: torch.Tensor, flat: _Flat) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    return {key: (cos.contiguous(), sin.contiguous())  # (T, hd)
            for key, (cos, sin) in runner._rotary_tables(x, flat.positions).items()}


def _window_rows(flat: _Flat, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first key row, number of keys) per token for a layer with this sliding window: the last `window`
    positions of its slot, its own included (HF's sliding-window mask)."""
    if window is None:
        return flat.key_row, flat.num_keys
    first = (flat.positions + 1 - window).clamp(min=0)
    return flat.key_row + first, flat.positions + 1 - first


def forward_fused(runner: TargetRunner, chunks: list[SeqChunk], hidden_layers: tuple[int, ...]) -> ForwardOutput:
    flat = _flatten(chunks, runner.cache.max_model_len)
    x = runner.embed_tokens(flat.ids).contiguous()  # (T, D), updated in place layer by layer
    cos, sin = _rotary(runner, x, flat)[None]  # plain Llama layers only: one table
    hidden = {0: x.clone()} if 0 in hidden_layers else {}
    hidden |= runner.fused.forward(x, runner.cache.k, runner.cache.v, flat.cache_row, flat.key_row, flat.num_keys,
                                   cos, sin, flat.max_keys, hidden_layers)
    return _logits(runner, x, flat, hidden)


def forward_native_attention(runner: TargetRunner, chunks: list[SeqChunk],
                             hidden_layers: tuple[int, ...]) -> ForwardOutput:
    flat = _flatten(chunks, runner.cache.max_model_len)
    x = runner.embed_tokens(flat.ids)  # (T, D)
    tables = _rotary(runner, x, flat)
    keys = {ly.window: _window_rows(flat, ly.window) for ly in runner.layers}
    hidden: dict[int, torch.Tensor] = {0: x} if 0 in hidden_layers else {}
    num_tokens = x.shape[0]
    kernel = runner.gemm_plan.kernel(num_tokens)
    num_heads, num_kv, hd = runner.num_heads, runner.num_kv_heads, runner.head_dim
    mlp_out: torch.Tensor | None = None  # the last layer's MLP output, added to x in the next layer's norm pass
    for i, layer in enumerate(runner.layers):
        if mlp_out is None:
            h = rms_norm(x, layer.in_norm, runner.eps)
        else:
            x, h = add_rms_norm(x, mlp_out, layer.in_norm, runner.eps)
        qkv = layer.qkv(h, kernel).contiguous()  # (T, (H + 2 KV) * hd)
        if layer.q_norm is not None:  # per-head q / k norms before the rotary, in place
            qk = qkv[:, :(num_heads + num_kv) * hd].view(num_tokens, num_heads + num_kv, hd)
            qk.copy_(head_norms(qk, layer, num_heads, runner.eps))
        cos, sin = tables[layer.rotary_key]
        native.rotary_cache_write(qkv, cos, sin, runner.cache.k[i], runner.cache.v[i], flat.cache_row, num_heads)
        key_row, num_keys = keys[layer.window]
        attn = native.attention(qkv.view(num_tokens, num_heads + 2 * num_kv, hd), num_heads, runner.cache.k[i],
                                runner.cache.v[i], key_row, num_keys, flat.max_keys, runner.scale)
        x, mlp_out = attention_out_and_mlp_parts(layer, x, attn, kernel, runner.eps, runner.activation)
        if i + 1 in hidden_layers or i + 1 == len(runner.layers):
            x, mlp_out = x + mlp_out, None
        if i + 1 in hidden_layers:
            hidden[i + 1] = x
    return _logits(runner, x, flat, hidden)
