"""Flattened variable-length forward pass of a Llama-family target over a slot KV cache.

One call runs every participating request's new tokens (a prompt chunk, or 1 + ℓ_r verification
tokens) as ONE flattened (T, D) batch through the linear layers: no request is padded to the longest
for the matmuls, which is where the time goes. Only the attention reads a padded (R, H, q_max, L_k)
query view against each request's own cache slot, with a causal mask; q_max is 1 + the longest
verification length (≤ 8), so that padding is negligible. Weights are the HF module's, fused
(q|k|v and gate|up) to cut per-layer dispatch, which dominates a 135M model on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.models.kv_cache import KVCachePool

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


class TargetRunner:
    """Runs a Llama-family HF causal LM over flattened variable-length batches."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int) -> None:
        arch = (model.config.architectures or [type(model).__name__])[0]
        if type(model).__name__ not in SUPPORTED_ARCHITECTURES and arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported by the flattened runner "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        cfg = model.config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.scale = self.head_dim ** -0.5
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        base = model.model
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.lm_head = model.lm_head.weight
        self.rotary = base.rotary_emb
        self.layers = [self._fuse(layer) for layer in base.layers]
        self.cache = KVCachePool(self.num_layers, self.num_kv_heads, self.head_dim, max_num_seqs,
                                 max_model_len, self.dtype, self.device)

    @staticmethod
    def _fuse(layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_b = None
        if attn.q_proj.bias is not None:
            qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
        return _Layer(
            in_norm=layer.input_layernorm.weight.detach(),
            qkv_w=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
            qkv_b=qkv_b,
            o_w=attn.o_proj.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up_w=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
            down_w=mlp.down_proj.weight.detach(),
        )

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Write the chunks' K/V into their slots and return logits (and chosen hidden states).

        Chunks must occupy a contiguous range of slots (any order); the attention reads a view of it.
        """
        dev = self.device
        slot_lo = min(c.slot for c in chunks)
        num_rows = max(c.slot for c in chunks) - slot_lo + 1
        q_max = max(len(c.token_ids) for c in chunks)
        num_keys = max(c.start_pos + len(c.token_ids) for c in chunks)
        if num_keys > self.cache.max_model_len:
            raise ValueError(f"sequence of {num_keys} tokens exceeds max_model_len={self.cache.max_model_len}")
        token_ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        pad_rows: list[int] = []
        logit_rows: list[int] = []
        row_start = torch.zeros(num_rows, dtype=torch.long)
        for c in chunks:
            n = len(c.token_ids)
            base = len(token_ids)
            token_ids += c.token_ids
            slots += [c.slot] * n
            positions += range(c.start_pos, c.start_pos + n)
            row = c.slot - slot_lo
            pad_rows += range(row * q_max, row * q_max + n)
            logit_rows += range(base + n - c.num_logits, base + n)
            row_start[row] = c.start_pos
        ids = torch.tensor(token_ids, device=dev)
        slot_idx = torch.tensor(slots, device=dev)
        pos_idx = torch.tensor(positions, device=dev)
        pad_idx = torch.tensor(pad_rows, device=dev)
        # key k visible to padded query i of row s iff k <= start_s + i (causal within the chunk)
        q_pos = row_start.to(dev)[:, None] + torch.arange(q_max, device=dev)[None, :]  # (R, q_max)
        mask = torch.arange(num_keys, device=dev)[None, None, :] <= q_pos[:, :, None]  # (R, q_max, L_k)
        mask = mask[:, None]  # (R, 1, q_max, L_k)

        x = F.embedding(ids, self.embed)  # (T, D)
        cos, sin = self.rotary(x[None], pos_idx[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # (T, 1, hd)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x
        num_tokens = ids.shape[0]
        nq, nkv, hd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.in_norm, self.eps)
            qkv = _linear(h, layer.qkv_w, layer.qkv_b)
            q = qkv[:, :nq].view(num_tokens, self.num_heads, hd)
            k = qkv[:, nq:nq + nkv].view(num_tokens, self.num_kv_heads, hd)
            v = qkv[:, nq + nkv:].view(num_tokens, self.num_kv_heads, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.cache.write(i, slot_idx, pos_idx, k, v)
            q_pad = q.new_zeros(num_rows * q_max, self.num_heads, hd)
            q_pad[pad_idx] = q
            q_pad = q_pad.view(num_rows, q_max, self.num_heads, hd).transpose(1, 2)  # (R, H, q_max, hd)
            k_all, v_all = self.cache.view(i, slot_lo + num_rows, num_keys)
            attn = F.scaled_dot_product_attention(
                q_pad, k_all[slot_lo:], v_all[slot_lo:], attn_mask=mask, scale=self.scale, enable_gqa=True)
            attn = attn.transpose(1, 2).reshape(num_rows * q_max, nq)[pad_idx]  # (T, H*hd)
            x = x + _linear(attn, layer.o_w)
            h = F.rms_norm(x, (x.shape[-1],), layer.post_norm, self.eps)
            gate, up = _linear(h, layer.gate_up_w).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, layer.down_w)
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        rows = x[torch.tensor(logit_rows, device=dev)] if len(logit_rows) < num_tokens else x
        logits = _linear(F.rms_norm(rows, (rows.shape[-1],), self.final_norm, self.eps), self.lm_head)
        return ForwardOutput(logits=logits, hidden_states=hidden)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T computed as (weight @ x.T).T with x row-major, padded to a multiple of 8 past 8 rows.

    With few rows (decode and verification: T ≤ a few dozen) MKL's kernel for the weight as the left
    operand is 2-4x faster on this AVX2 CPU than F.linear's (LM head 49152x576, 16 rows: 13 ms vs 22 ms),
    on two conditions measured here (`dspark bench batching` shows them on whole steps):
    - x must be row-major. The outputs of this function are transposed views, and the elementwise ops
      after them keep that column-major layout; fed back as is, 2-9 rows run 3-5x slower (LM head,
      2 rows: 18.9 ms column-major, 4.8 ms row-major).
    - past 8 rows, the row count must be a multiple of 8: at 9-15 or 17-31 rows the kernel falls 2-3x
      behind its own time for the next multiple (LM head: 27 ms at 15 rows, 13 ms at 16). Zero rows up
      to that multiple cost less than the slow path.
    The result is a (transposed) view, which the following ops accept.
    """
    rows = x.shape[0]
    pad = -rows % 8 if rows > 8 else 0
    x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x.contiguous()
    out = torch.mm(weight, x.t()).t()
    if pad:
        out = out[:rows]
    return out + bias if bias is not None else out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
