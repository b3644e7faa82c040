"""Flattened variable-length forward pass of a decoder-only target over a slot KV cache.

Every family described in `family.py` (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma 3) runs here:
the description says which norms, activation, scales, sliding windows and experts a layer has; this file
holds the math once. `TargetRunner(model, ...)` of any other causal LM returns the generic transformers
runner (`generic_runner.py`) and logs why.

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
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from dspark.kernels import native
from dspark.kernels.cache_once import cache_dir
from dspark.kernels.gemm_plan import GemmPlan, PlannedLinear, head_output, plan_for
from dspark.kernels.native import FusedDecoder
from dspark.models.target.family import (
    activation_of,
    architecture_of,
    family_of,
    is_plain_llama,
    layer_weights,
    query_scale,
    unsupported_reason,
)
from dspark.models.target.generic_runner import GenericRunner
from dspark.models.target.kv_cache import KVCachePool
from dspark.models.target.layer import ForwardOutput, SeqChunk, attention_out_and_mlp, head_norms, rms_norm
from dspark.models.target.native_forward import forward_fused, forward_native_attention
from dspark.models.target.rotary_table import RotaryTable, is_static

log = logging.getLogger(__name__)

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


def native_blocker(model: torch.nn.Module) -> str | None:
    """Why this model cannot run on the flattened runner (None: it can)."""
    family = family_of(model)
    if family is None:
        return f"no native description of {architecture_of(model)} (dspark/models/target/family.py)"
    return unsupported_reason(family, model.config)


class TargetRunner:
    """Runs a HF causal LM over flattened variable-length batches (any family `family.py` describes).

    Constructing one for a model no family describes returns a `GenericRunner` instead (same interface):
    no architecture that transformers loads is refused."""

    def __new__(cls, model: torch.nn.Module, *args: object, **kwargs: object) -> TargetRunner:
        reason = native_blocker(model) if cls is TargetRunner else None
        if reason is None:
            return super().__new__(cls)
        log.info("target %s: the generic transformers path (generic_runner.py), "
                 "because %s", architecture_of(model), reason)
        return GenericRunner(model, *args, **kwargs)  # type: ignore[return-value]  # same interface

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int,
                 gemm_plan: GemmPlan | None = None, row_invariant: bool = True) -> None:
        """`row_invariant`: only GEMM kernels whose rows do not depend on the row count (bf16: see
        `gemm_plan`); verification needs it, bulk target-only generation does not."""
        family = family_of(model)
        assert family is not None  # __new__ sent every other model to the generic runner
        cfg = model.config
        self.family = family
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.scale = query_scale(cfg, self.head_dim)
        self.activation = activation_of(cfg)
        self.logit_softcap: float | None = getattr(cfg, "final_logit_softcapping", None)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        base = model.model
        self.embed = base.embed_tokens.weight
        # Gemma: embeddings × √D, rounded to the weights' dtype as HF does
        self.embed_scale = (torch.tensor(cfg.hidden_size ** 0.5).to(self.dtype).item()
                            if family.scales_embeddings else None)
        self.final_norm = (base.norm.weight.detach().float() + family.norm_offset if family.norm_offset
                           else base.norm.weight)
        self.lm_head = PlannedLinear(model.lm_head.weight, name="lm_head")
        self.rotary = base.rotary_emb
        self.layers = [layer_weights(family, layer, i, cfg) for i, layer in enumerate(base.layers)]
        for ly in self.layers:
            if ly.window is not None and ly.window >= max_model_len:
                ly.window = None  # never reached: full attention (and the native paths) computes the same
        probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
        self.rotary_table: RotaryTable | None = None
        self.rotary_dim = self._rotary_tables(probe[0], torch.zeros(1, dtype=torch.long,
                                                                     device=self.device))[self.layers[0].rotary_key][0].shape[-1]
        if is_static(self.rotary):  # forward never reaches a position past max_model_len (it checks)
            self.rotary_table = RotaryTable(self._rotary_tables, probe[0], max_model_len)
        linears = [lin for ly in self.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down) if lin is not None]
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
                      and is_plain_llama(family, self.layers, cfg, self.rotary_dim, self.head_dim)
                      and FusedDecoder.supports(self.layers)
                      and native.supports_attention(torch.float32, self.num_heads, self.num_kv_heads, self.head_dim)
                      else None)
        # attention of decode / verify tokens in native code at any batch: the CPU SDPA kernel was ~1/3 of a
        # large fp32 step and half of a bf16 one. bf16 verification too: the native kernel computes each token
        # alone (its arithmetic does not depend on what else the step carries), so a token's bf16 logits are
        # the same in a verify block as in a one-token step, which `row_invariance.is_row_invariant` checks on
        # the whole forward. Against the key-block-padded SDPA path it needs no (R, q_max) padding of ragged
        # verify lengths: SmolLM2 bf16 on the 2-core AMX Xeon, 8 requests verifying 15 tokens of mixed
        # lengths, 28.3 vs 35.7-37.7 ms a step; 8 one-token rows 25.0 vs 31.2 ms
        self.native_attention = (self.device.type == "cpu" and self.rotary_dim == self.head_dim
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

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed)  # (T, D)
        return x * self.embed_scale if self.embed_scale is not None else x

    def _rotary_tables(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, ...]]:
        """cos, sin (T, rotary_dim) per rotary table the layers use (Gemma 3: one per layer type)."""
        if self.rotary_table is not None:
            return self.rotary_table.lookup(positions)
        tables = {}
        for key in {ly.rotary_key for ly in self.layers}:
            cos, sin = (self.rotary(x[None], positions[None]) if key is None
                        else self.rotary(x[None], positions[None], key))
            tables[key] = (cos[0], sin[0])
        return tables

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and (Gemma) soft-capping of the rows (N, D) that want logits: (N, V), row-major
        (every consumer reduces over a row; see `head_output`)."""
        kernel = self.gemm_plan.kernel(rows.shape[0], is_head=True)
        logits = head_output(self.lm_head(rms_norm(rows, self.final_norm, self.eps), kernel))
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

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
        key_pos = torch.arange(num_keys, device=dev)[None, None, :]
        # queries of the G heads that share a KV head fold into one (G * q_max) query block per KV
        # head: the attention then reads each KV head once instead of G times (2x at decode on CPU)
        group = self.num_heads // self.num_kv_heads
        group_masks: dict[int | None, list[torch.Tensor]] = {}  # per sliding window (None: full attention)
        for window in {ly.window for ly in self.layers}:
            mask = key_pos <= q_pos[:, :, None]  # (R, q_max, L_k)
            if window is not None:  # HF's sliding window: the last `window` positions, the query's included
                mask &= key_pos > q_pos[:, :, None] - window
            mask = mask.repeat(1, group, 1)[:, None]  # (R, 1, G * q_max, L_k)
            group_masks[window] = [mask[lo:hi, :, :, :keys].contiguous() for lo, hi, keys in attn_groups]

        x = self.embed_tokens(ids)  # (T, D)
        tables = {key: (cos[:, None, :], sin[:, None, :])  # (T, 1, rotary_dim)
                  for key, (cos, sin) in self._rotary_tables(x, pos_idx).items()}
        hidden: dict[int, torch.Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x
        num_tokens = ids.shape[0]
        kernel = self.gemm_plan.kernel(num_tokens)
        cache_rows = self.cache.rows(slot_idx, pos_idx)
        nq, nkv, hd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(rms_norm(x, layer.in_norm, self.eps, allow_native=False), kernel)
            qk = qkv[:, :nq + nkv].view(num_tokens, self.num_heads + self.num_kv_heads, hd)
            qk = self._rotary(head_norms(qk, layer, self.num_heads, self.eps), *tables[layer.rotary_key])
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
            for (lo, hi, keys), group_mask in zip(attn_groups, group_masks[layer.window]):
                k_all, v_all = self.cache.view(i, slot_lo + hi, keys)
                parts.append(F.scaled_dot_product_attention(
                    q_grouped[lo:hi], k_all[slot_lo + lo:], v_all[slot_lo + lo:], attn_mask=group_mask,
                    scale=self.scale))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            # reshape, not view: CUDA's SDPA kernels return (R, H, q_max, hd) laid out as (R, q_max, H, hd)
            attn = attn.reshape(num_rows, self.num_heads, q_max, hd).transpose(1, 2).reshape(num_rows * q_max, nq)
            if pad_idx is not None:
                attn = attn[pad_idx]  # (T, H*hd)
            x = attention_out_and_mlp(layer, x, attn, kernel, self.eps, self.activation)
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        rows = x[torch.tensor(logit_rows, device=dev)] if len(logit_rows) < num_tokens else x
        return ForwardOutput(logits=self.logits(rows), hidden_states=hidden)

    def _rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on q and k at once (T, H + KV, hd); a partial rotary (Phi-3 with partial_rotary_factor < 1)
        turns only the first rotary_dim features of each head."""
        if self.rotary_dim == self.head_dim:
            return qk * cos + _rotate_half(qk) * sin
        turned, kept = qk[..., :self.rotary_dim], qk[..., self.rotary_dim:]
        return torch.cat([turned * cos + _rotate_half(turned) * sin, kept], dim=-1)

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
