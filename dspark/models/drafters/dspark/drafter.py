"""DSparkDrafter: the FeatureDrafter around a DSparkModel, with a per-request draft-side context cache.

`observe` queues each new target feature row; the rows are projected ONCE into every draft layer's K
(RoPE'd at its absolute position) and V when a draft needs them (or when many are queued), appended to the
request's cache: O(n) work per observed token, never a recompute of the context, and one projection call
per request and draft round rather than one per target step (the engine's draft gate may skip drafting
for many steps). `propose` pads the batch's caches to the longest, runs one batched backbone pass over the γ block
positions and the sequential head, and returns target-vocab ids, draft distributions (sampled requests
only) and confidences.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.kernels.cache_once import cache_dir
from dspark.models.drafters import target_signature
from dspark.models.drafters.base import DraftOutput, DraftRequest
from dspark.models.drafters.dspark.model import DSparkModel
from dspark.models.target.loader import TargetModel

_MAX_PENDING_ROWS = 256


class _ContextCache:
    """One request's projected context: (num_layers, 2, Hkv, capacity, hd), the first `length` rows filled."""

    def __init__(self, template: torch.Tensor, capacity: int) -> None:
        shape = template.shape[:-2] + (max(capacity, 64), template.shape[-1])
        self.buffer = template.new_empty(shape)
        self.length = 0

    def append(self, kv: torch.Tensor) -> None:
        """kv (num_layers, 2, Hkv, n, hd) for the next n positions."""
        n = kv.shape[-2]
        if self.length + n > self.buffer.shape[-2]:  # grow geometrically: amortised O(1) per row
            grown = self.buffer.new_empty(self.buffer.shape[:-2] + (2 * (self.length + n), self.buffer.shape[-1]))
            grown[..., :self.length, :] = self.buffer[..., :self.length, :]
            self.buffer = grown
        self.buffer[..., self.length:self.length + n, :] = kv
        self.length += n

    def view(self) -> torch.Tensor:
        return self.buffer[..., :self.length, :]


class DSparkDrafter:
    """Drafts with a DSpark model from target hidden states (implements `FeatureDrafter`)."""

    name = "dspark"

    def __init__(self, model: DSparkModel, target: TargetModel, device: str | torch.device | None = None,
                 seed: int = 0) -> None:
        self.device = torch.device(device) if device is not None else target.device
        self.model = model.to(self.device).eval()
        hf = target.model
        self.model.attach_target(hf.get_input_embeddings().weight, hf.get_output_embeddings().weight)
        if self.device.type == "cpu":  # few rows per GEMM: the kernels measured fastest here (draft_gemm.py)
            self.model.plan_gemm(cache_dir())
        self.hidden_layers: tuple[int, ...] = tuple(model.config.target_layers)
        self.block_size = model.config.block_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._contexts: dict[str, _ContextCache] = {}
        self._pending: dict[str, list[torch.Tensor]] = {}  # observed rows not yet projected, per request
        self._num_pending: dict[str, int] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path, target: TargetModel, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, seed: int = 0) -> DSparkDrafter:
        """Load a DSpark checkpoint folder and attach it to `target` (same device/dtype as the target by default)."""
        dev = device if device is not None else target.device
        model = DSparkModel.from_pretrained(path, device=dev, dtype=dtype or target.dtype)
        target_signature.check(model.config, target.model.config, path)  # another target: refused, with why
        return cls(model, target, dev, seed)

    @torch.inference_mode()
    def observe(self, request_id: str, features: torch.Tensor) -> None:
        """Queue the features (n, taps*D_t) of the request's next n context positions."""
        if features.shape[0] == 0:
            return
        self._pending.setdefault(request_id, []).append(features.to(self.device, copy=True))
        self._num_pending[request_id] = self._num_pending.get(request_id, 0) + features.shape[0]
        if self._num_pending[request_id] >= _MAX_PENDING_ROWS:  # bound the queue of a request that never drafts
            self._flush(request_id)

    def _flush(self, request_id: str) -> None:
        """Project the request's queued rows in one call and append their K/V to its cache."""
        rows = self._pending.pop(request_id, None)
        self._num_pending.pop(request_id, None)
        if not rows:
            return
        cache = self._contexts.get(request_id)
        start = 0 if cache is None else cache.length
        kv = self.model.context_kv(torch.cat(rows) if len(rows) > 1 else rows[0], start)  # (layers, 2, Hkv, n, hd)
        if cache is None:
            cache = self._contexts[request_id] = _ContextCache(kv, 2 * kv.shape[-2])
        cache.append(kv)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        """Draft min(max_num_tokens, γ) tokens per request in one batched pass."""
        num_tokens = min(max_num_tokens, self.block_size)
        if not requests or num_tokens <= 0:
            return DraftOutput(tokens=[[] for _ in requests])
        caches = [self._context_of(r) for r in requests]
        lengths = [c.length for c in caches]
        if len(requests) == 1:  # no padding, no mask, no copy
            context_kv, context_lens = caches[0].view().unsqueeze(2), None
        else:
            template = caches[0].buffer
            context_kv = template.new_zeros(template.shape[:2] + (len(requests),) + template.shape[2:3]
                                            + (max(lengths), template.shape[-1]))  # (layers, 2, R, Hkv, L, hd)
            for r, cache in enumerate(caches):
                context_kv[:, :, r, :, :cache.length] = cache.view()
            context_lens = torch.tensor(lengths, device=self.device)
        anchor_ids = torch.tensor([r.token_ids[-1] for r in requests], device=self.device)
        anchor_pos = torch.tensor(lengths, device=self.device)  # the anchor follows its observed context
        is_sampled = any(r.temperature > 0 for r in requests)
        temps = torch.tensor([r.temperature for r in requests], device=self.device) if is_sampled else None
        block = self.model.draft(context_kv, anchor_ids, anchor_pos, context_lens, temps, num_tokens,
                                 self.generator)
        target_ids = self.model.draft_to_target[block.draft_ids]  # (R, k)
        probs = None
        if block.probs is not None:
            vocab = self.model.config.target_vocab_size
            full = block.probs.new_zeros(block.probs.shape[:2] + (vocab,))  # (R, k, V_t): 0 outside the draft vocab
            full[..., self.model.draft_to_target] = block.probs
            probs = list(full.float().unbind(0))
        # one host transfer: ids are exact in float64
        packed = target_ids.double()
        if block.confidences is not None:
            packed = torch.cat([packed, block.confidences.double()], dim=1)
        rows = packed.tolist()
        tokens = [[int(t) for t in row[:num_tokens]] for row in rows]
        confidences = [row[num_tokens:] for row in rows] if block.confidences is not None else None
        return DraftOutput(tokens=tokens, probs=probs, confidences=confidences)

    def _context_of(self, request: DraftRequest) -> _ContextCache:
        self._flush(request.request_id)
        cache = self._contexts.get(request.request_id)
        expected = len(request.token_ids) - 1
        if cache is None or cache.length != expected:
            have = 0 if cache is None else cache.length
            raise ValueError(f"request {request.request_id!r}: observed features of {have} tokens, but the "
                             f"anchor needs exactly the {expected} tokens before it")
        return cache

    def release(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._num_pending.pop(request_id, None)
