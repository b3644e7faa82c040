"""Flattened variable-length forward pass of a Llama-family target over a slot KV cache.

One call runs every participating request's new tokens (a prompt chunk, or 1 + ℓ_r verification
tokens) as ONE flattened (T, D) batch through the linear layers: no request is padded to the longest
for the matmuls, which is where the time goes. Only the attention reads a padded (R, H, q_max, L_k)
query view against each request's own cache slot, with a causal mask; q_max is 1 + the longest
verification length (≤ 8), so that padding is negligible. Weights are the HF module's, fused
(q|k|v and gate|up) to cut per-layer dispatch, and each GEMM runs the kernel that a per-machine
measurement found fastest at its row count (`gemm_plan.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.models import native
from dspark.models.gemm_plan import GemmPlan, PlannedLinear, plan_for
from dspark.models.kv_cache import KVCachePool
from dspark.models.native import FusedDecoder
from dspark.models.native_forward import forward_fused, forward_native_attention
from dspark.models.target import cache_dir

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Keys attention reads per step, rounded up to a multiple of this (masked past the real length) where
# the runner must be row-invariant in a low-precision dtype: the CPU SDPA kernel's bf16 result for a
# query is then the same whatever else the step holds (blocks of 64: bf16 speculation equals bf16
# target-only decoding on SmolLM2; blocks of 16 did not). fp32 GEMMs are not row-invariant anyway
# (their ~1e-7 differences do not flip greedy choices), so fp32 and bulk generation read exact lengths.
KEY_BLOCK = 64
ATTENTION_GROUP_ROWS = 32  # rows per attention call when their lengths differ (see _attention_groups)
# native attention (one query at a time) for decode and verify steps, and for prompt chunks whose sequences
# end within NATIVE_ATTENTION_MAX_KEYS; longer prompts take the CPU SDPA kernel, whose tiles reuse each key
# across queries. SmolLM2 prefill on a 2-core AMD EPYC (Zen 5), native / SDPA tok/s: 64 prompts of 20-220
# tokens 1.10 (bf16) and 1.36 (fp32); 16 of 200: 1.03 / 1.08; 16 of 300: 0.84 / 1.01; 2 of 1000: 0.80 / 0.96
NATIVE_ATTENTION_MAX_QUERY = 16
NATIVE_ATTENTION_MAX_KEYS = 256
ATTENTION_MIN_SAVING = 32  # keys the shortest run must save before splitting the call is worth it


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
    qkv: PlannedLinear
    o: PlannedLinear
    post_norm: torch.Tensor
    gate_up: PlannedLinear
    down: PlannedLinear


class TargetRunner:
    """Runs a Llama-family HF causal LM over flattened variable-length batches."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int,
                 gemm_plan: GemmPlan | None = None, row_invariant: bool = True) -> None:
        """`row_invariant`: only GEMM kernels whose rows do not depend on the row count (bf16: see
        `gemm_plan`); verification needs it, bulk target-only generation does not."""
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
        self.lm_head = PlannedLinear(model.lm_head.weight, name="lm_head")
        self.rotary = base.rotary_emb
        self.layers = [self._fuse(layer) for layer in base.layers]
        linears = [lin for ly in self.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)]
        if gemm_plan is None:
            gemm_plan = plan_for(linears, self.lm_head, cache_dir(), row_invariant)
        elif gemm_plan.uses_packed:
            for lin in linears + [self.lm_head]:
                lin.pack()
        self.gemm_plan = gemm_plan
        self.row_invariant = row_invariant
        self.cache = KVCachePool(self.num_layers, self.num_kv_heads, self.head_dim, max_num_seqs,
                                 max_model_len, self.dtype, self.device)
        # few-token fp32 steps: the whole decoder stack in native code where the plan measured the native
        # GEMM fastest at that row count (PyTorch's small ops cost as much as the math there)
        self.fused = (FusedDecoder(self.layers, self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
                                   self.scale) if "native" in gemm_plan.layer_kernels.values()
                      and FusedDecoder.supports(self.layers)
                      and native.supports_attention(torch.float32, self.num_heads, self.num_kv_heads, self.head_dim)
                      else None)
        # attention of decode / verify tokens in native code at any batch: the CPU SDPA kernel was ~1/3 of a
        # large fp32 step and half of a bf16 one. bf16 only where rows need not match the SDPA path's rounding
        # (bulk generation): bf16 verification keeps the key-block-padded SDPA path its losslessness tests cover
        self.native_attention = (self.device.type == "cpu"
                                 and (self.dtype == torch.float32 or not row_invariant)
                                 and native.supports_attention(self.dtype, self.num_heads, self.num_kv_heads,
                                                               self.head_dim))

    @contextlib.contextmanager
    def scratch_cache(self, num_seqs: int, max_len: int) -> Iterator[KVCachePool]:
        """A temporary KV pool of `num_seqs` slots × `max_len` positions in place of the serving cache:
        forwards inside it recompute what the cached requests already hold (their features) without
        touching their K/V. Engine thread only, like every forward."""
        kept = self.cache
        self.cache = KVCachePool(self.num_layers, self.num_kv_heads, self.head_dim, num_seqs,
                                 min(max_len, kept.max_model_len), self.dtype, self.device)
        try:
            yield self.cache
        finally:
            self.cache = kept

    def takes_native_attention(self, chunks: list[SeqChunk]) -> bool:
        """Whether a forward of these chunks attends in native code: every chunk a few tokens (decode,
        verify) or a prompt chunk ending within NATIVE_ATTENTION_MAX_KEYS (see there)."""
        return self.native_attention and all(
            len(c.token_ids) <= NATIVE_ATTENTION_MAX_QUERY
            or c.start_pos + len(c.token_ids) <= NATIVE_ATTENTION_MAX_KEYS
            for c in chunks)

    @staticmethod
    def _fuse(layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_b = None
        if attn.q_proj.bias is not None:
            qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
        return _Layer(
            in_norm=layer.input_layernorm.weight.detach(),
            qkv=PlannedLinear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), qkv_b),
            o=PlannedLinear(attn.o_proj.weight),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=PlannedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
            down=PlannedLinear(mlp.down_proj.weight),
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
        # Attention reads keys up to a multiple of KEY_BLOCK (the rest masked): a token's logits then do
        # not depend on the step's shape (bf16 greedy speculation equals bf16 target-only decoding).
        if self.fused is not None and self.gemm_plan.kernel(sum(len(c.token_ids) for c in chunks)) == "native":
            return forward_fused(self, chunks, hidden_layers)
        if self.takes_native_attention(chunks):
            return forward_native_attention(self, chunks, hidden_layers)
        block = KEY_BLOCK if self.row_invariant and self.dtype in (torch.bfloat16, torch.float16) else 1
        num_keys = min(-(-num_keys // block) * block, self.cache.max_model_len)
        row_end = [0] * num_rows
        for c in chunks:
            row_end[c.slot - slot_lo] = c.start_pos + len(c.token_ids)
        attn_groups = self._attention_groups(row_end, block)
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
        # every row full and in slot order (decode, equal verify lengths): the padded view is the batch
        is_dense = pad_rows == list(range(num_rows * q_max))
        pad_idx = None if is_dense else torch.tensor(pad_rows, device=dev)
        # key k visible to padded query i of row s iff k <= start_s + i (causal within the chunk)
        q_pos = row_start.to(dev)[:, None] + torch.arange(q_max, device=dev)[None, :]  # (R, q_max)
        mask = torch.arange(num_keys, device=dev)[None, None, :] <= q_pos[:, :, None]  # (R, q_max, L_k)
        # queries of the G heads that share a KV head fold into one (G * q_max) query block per KV
        # head: the attention then reads each KV head once instead of G times (2x at decode on CPU)
        group = self.num_heads // self.num_kv_heads
        mask = mask.repeat(1, group, 1)[:, None]  # (R, 1, G * q_max, L_k)
        group_masks = [mask[lo:hi, :, :, :keys].contiguous() for lo, hi, keys in attn_groups]

        x = F.embedding(ids, self.embed)  # (T, D)
        cos, sin = self.rotary(x[None], pos_idx[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # (T, 1, hd)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x
        num_tokens = ids.shape[0]
        kernel = self.gemm_plan.kernel(num_tokens)
        cache_rows = self.cache.rows(slot_idx, pos_idx)
        nq, nkv, hd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.in_norm, self.eps)
            qkv = layer.qkv(h, kernel)
            qk = qkv[:, :nq + nkv].view(num_tokens, self.num_heads + self.num_kv_heads, hd)
            qk = qk * cos + _rotate_half(qk) * sin  # rotary on q and k at once
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, nq + nkv:].view(num_tokens, self.num_kv_heads, hd)
            self.cache.write(i, cache_rows, k, v)
            if pad_idx is None:
                q_pad = q
            else:
                q_pad = q.new_zeros(num_rows * q_max, self.num_heads, hd)
                q_pad[pad_idx] = q
            q_pad = q_pad.reshape(num_rows, q_max, self.num_heads, hd).transpose(1, 2)  # (R, H, q_max, hd)
            # contiguous: a transposed GEMM output ("wx") leaves head_dim strided, and SDPA then takes a
            # path whose rounding depends on the batch (bf16 logits would change with the step's shape)
            q_grouped = q_pad.reshape(num_rows, self.num_kv_heads, group * q_max, hd).contiguous()
            parts = []
            for (lo, hi, keys), group_mask in zip(attn_groups, group_masks):
                k_all, v_all = self.cache.view(i, slot_lo + hi, keys)
                parts.append(F.scaled_dot_product_attention(
                    q_grouped[lo:hi], k_all[slot_lo + lo:], v_all[slot_lo + lo:], attn_mask=group_mask,
                    scale=self.scale))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            attn = attn.view(num_rows, self.num_heads, q_max, hd).transpose(1, 2).reshape(num_rows * q_max, nq)
            if pad_idx is not None:
                attn = attn[pad_idx]  # (T, H*hd)
            x = attention_out_and_mlp(layer, x, attn, kernel, self.eps)
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        rows = x[torch.tensor(logit_rows, device=dev)] if len(logit_rows) < num_tokens else x
        head_kernel = self.gemm_plan.kernel(rows.shape[0], is_head=True)
        logits = self.lm_head(F.rms_norm(rows, (rows.shape[-1],), self.final_norm, self.eps), head_kernel)
        return ForwardOutput(logits=logits, hidden_states=hidden)

    def _attention_groups(self, row_end: list[int], block: int) -> list[tuple[int, int, int]]:
        """(first row, end row, keys to read) per attention call.

        One call reads every row's keys up to the LONGEST row's length (the rest masked), which at 256
        sequences of 60-280 tokens is 3x the keys needed. So rows go in runs of ATTENTION_GROUP_ROWS,
        each reading up to its own longest row (rounded up to `block`); runs that would read the same
        length merge back into one call.
        """
        groups: list[tuple[int, int, int]] = []
        cap = self.cache.max_model_len
        for lo in range(0, len(row_end), ATTENTION_GROUP_ROWS):
            hi = min(len(row_end), lo + ATTENTION_GROUP_ROWS)
            keys = min(-(-max(max(row_end[lo:hi]), 1) // block) * block, cap)
            if groups and groups[-1][2] == keys:
                groups[-1] = (groups[-1][0], hi, keys)
            else:
                groups.append((lo, hi, keys))
        if len(groups) > 1 and max(k for *_, k in groups) - min(k for *_, k in groups) < ATTENTION_MIN_SAVING:
            return [(0, len(row_end), max(k for *_, k in groups))]  # too little to save for the extra calls
        return groups


def attention_out_and_mlp(layer: _Layer, x: torch.Tensor, attn: torch.Tensor, kernel: str, eps: float) -> torch.Tensor:
    """The rest of a decoder layer after attention (T, H*hd): o projection and residual, then the MLP block."""
    x = x + layer.o(attn, kernel)
    if x.dtype == torch.float32 and x.device.type == "cpu" and native.is_available():  # one pass each
        gate_up = layer.gate_up(native.rms_norm(x, layer.post_norm, eps), kernel)
        return x + layer.down(native.silu_mul(gate_up), kernel)
    h = F.rms_norm(x, (x.shape[-1],), layer.post_norm, eps)
    gate, up = layer.gate_up(h, kernel).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up, kernel)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
