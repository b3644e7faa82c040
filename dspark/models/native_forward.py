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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dspark.models import native

if TYPE_CHECKING:
    from dspark.models.runner import ForwardOutput, SeqChunk, TargetRunner


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
    from dspark.models.runner import ForwardOutput

    rows = x[torch.tensor(flat.logit_rows)] if len(flat.logit_rows) < x.shape[0] else x
    kernel = runner.gemm_plan.kernel(rows.shape[0], is_head=True)
    logits = runner.lm_head(F.rms_norm(rows, (rows.shape[-1],), runner.final_norm, runner.eps), kernel)
    return ForwardOutput(logits=logits, hidden_states=hidden)


def _rotary(runner: TargetRunner, x: torch.Tensor, flat: _Flat) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = runner.rotary(x[None], flat.positions[None])
    return cos[0].contiguous(), sin[0].contiguous()  # (T, hd)


def forward_fused(runner: TargetRunner, chunks: list[SeqChunk], hidden_layers: tuple[int, ...]) -> ForwardOutput:
    flat = _flatten(chunks, runner.cache.max_model_len)
    x = F.embedding(flat.ids, runner.embed).contiguous()  # (T, D), updated in place layer by layer
    cos, sin = _rotary(runner, x, flat)
    hidden = {0: x.clone()} if 0 in hidden_layers else {}
    hidden |= runner.fused.forward(x, runner.cache.k, runner.cache.v, flat.cache_row, flat.key_row, flat.num_keys,
                                   cos, sin, flat.max_keys, hidden_layers)
    return _logits(runner, x, flat, hidden)


def forward_native_attention(runner: TargetRunner, chunks: list[SeqChunk],
                             hidden_layers: tuple[int, ...]) -> ForwardOutput:
    from dspark.models.runner import attention_out_and_mlp  # runner imports this module

    flat = _flatten(chunks, runner.cache.max_model_len)
    x = F.embedding(flat.ids, runner.embed)  # (T, D)
    cos, sin = _rotary(runner, x, flat)
    hidden: dict[int, torch.Tensor] = {0: x} if 0 in hidden_layers else {}
    num_tokens = x.shape[0]
    kernel = runner.gemm_plan.kernel(num_tokens)
    num_heads, num_kv, hd = runner.num_heads, runner.num_kv_heads, runner.head_dim
    for i, layer in enumerate(runner.layers):
        h = (native.rms_norm(x, layer.in_norm, runner.eps) if x.dtype == torch.float32
             else F.rms_norm(x, (x.shape[-1],), layer.in_norm, runner.eps))
        qkv = layer.qkv(h, kernel).contiguous()  # (T, (H + 2 KV) * hd)
        native.rotary_cache_write(qkv, cos, sin, runner.cache.k[i], runner.cache.v[i], flat.cache_row, num_heads)
        attn = native.attention(qkv.view(num_tokens, num_heads + 2 * num_kv, hd), num_heads, runner.cache.k[i],
                                runner.cache.v[i], flat.key_row, flat.num_keys, flat.max_keys, runner.scale)
        x = attention_out_and_mlp(layer, x, attn, kernel, runner.eps)
        if i + 1 in hidden_layers:
            hidden[i + 1] = x
    return _logits(runner, x, flat, hidden)
