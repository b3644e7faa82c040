"""What every target forward shares: the chunk a request brings to a forward, what a forward returns, and the
layer math that the runner's PyTorch path and its native path (`native_forward.py`) both run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.kernels import native
from dspark.models.target.family import LayerWeights


@dataclass
class SeqChunk:
    """New tokens of one request in a forward: they sit at positions start_pos.. in cache slot `slot`."""

    slot: int
    start_pos: int
    token_ids: list[int]
    num_logits: int  # logits wanted for the last num_logits tokens of this chunk


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # (N, V): rows for each chunk's last num_logits tokens, chunk order
    hidden_states: dict[int, torch.Tensor]  # layer index -> (T, D) for the requested layers


def _native_norm_rows(x: torch.Tensor) -> bool:
    """CPU rows (T, d) the native one-pass norm takes: fp32, or bf16 where it rounds as PyTorch's to the bit
    (`native.bf16_norm_lanes`)."""
    return (x.device.type == "cpu" and x.dim() == 2 and native.is_available()
            and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and native.bf16_norm_lanes() is not None)))


def _native_silu_rows(h: torch.Tensor) -> bool:
    """CPU rows (T, d) whose MLP takes the native one-pass SiLU·up: fp32, or bf16 where it rounds as PyTorch's
    to the bit (`native.silu_bf16_table`)."""
    return (h.device.type == "cpu" and h.dim() == 2 and native.is_available()
            and (h.dtype == torch.float32 or (h.dtype == torch.bfloat16 and native.silu_bf16_table() is not None)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, allow_native: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim. A weight kept in fp32 for a low-precision x (Gemma's 1 + w) normalises in
    fp32 and rounds once, as HF does; fp32 and bf16 CPU rows take the native one-pass kernel where allowed."""
    if weight.dtype != x.dtype:
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    if allow_native and _native_norm_rows(x):
        return native.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm of it): one native pass for bf16 CPU rows (to the bit as PyTorch's add and
    RMSNorm round them), else the two ops."""
    if weight.dtype == x.dtype == residual.dtype == torch.bfloat16 and _native_norm_rows(x):
        return native.add_rms_norm(x, residual, weight, eps)
    total = x + residual
    return total, rms_norm(total, weight, eps)


def head_norms(qk: torch.Tensor, layer: LayerWeights, num_heads: int, eps: float) -> torch.Tensor:
    """Qwen3 / Gemma 3: each query head and each key head RMS-normalised (T, H + KV, hd) before the rotary."""
    if layer.q_norm is None:
        return qk
    return torch.cat([rms_norm(qk[:, :num_heads], layer.q_norm, eps),
                      rms_norm(qk[:, num_heads:], layer.k_norm, eps)], dim=1)


def attention_out_and_mlp(layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor, kernel: str, eps: float,
                          activation: str = "silu") -> torch.Tensor:
    """The rest of a decoder layer after attention (T, H*hd): o projection (Gemma: its output norm) and
    residual, then the MLP block (dense gate|up, or the sparse experts) and its residual."""
    x, y = attention_out_and_mlp_parts(layer, x, attn, kernel, eps, activation)
    return x + y


def attention_out_and_mlp_parts(layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor, kernel: str, eps: float,
                                activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_out_and_mlp` with its last residual left to the caller: (x after the attention residual, the
    MLP's output), so that the next layer's input norm can add them in its own pass (`add_rms_norm`)."""
    out = layer.o(attn, kernel)
    x, h = add_rms_norm(x, out if layer.attn_out_norm is None else rms_norm(out, layer.attn_out_norm, eps),
                        layer.post_norm, eps)
    if layer.moe is not None:
        y = layer.moe(h)
    elif activation == "silu" and _native_silu_rows(h):
        y = layer.down(native.silu_mul(layer.gate_up(h, kernel)), kernel)  # one pass for SiLU·up
    else:
        gate, up = layer.gate_up(h, kernel).chunk(2, dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        y = layer.down(act * up, kernel)
    return x, (y if layer.mlp_out_norm is None else rms_norm(y, layer.mlp_out_norm, eps))
