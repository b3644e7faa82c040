"""ARDrafter: the FeatureDrafter around an EAGLE-3 or MTP-1 model, with a per-request K/V cache.

Drafter position j needs the target feature of position j AND the token x_{j+1}, which the request's
token ids carry only at the next `propose`. So `observe` only stores the new feature rows (pending);
`propose` runs the pending positions through the layer in one batched pass, appends their K/V to the
request's cache (every pending position but the last, which stays pending so the next round always has
its first step to run), and drafts γ tokens left to right. Only real positions are cached: draft steps
are recomputed every round, so nothing is ever rolled back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.kernels.cache_once import cache_dir
from dspark.models.drafters import target_signature
from dspark.models.drafters.ar.model import ARDraftModel
from dspark.models.drafters.base import DraftOutput, DraftRequest
from dspark.models.target.loader import TargetModel


class _RequestState:
    """One request's cached K/V (2, Hkv, capacity, hd), first `num_cached` positions filled, and the
    observed feature rows not yet run through the layer."""

    def __init__(self) -> None:
        self.kv: torch.Tensor | None = None
        self.num_cached = 0
        self.pending: list[torch.Tensor] = []  # (n, taps*D_t) chunks
        self.num_observed = 0

    def append_kv(self, kv: torch.Tensor) -> None:
        """kv (2, Hkv, n, hd) of the next n positions."""
        n = kv.shape[-2]
        capacity = 0 if self.kv is None else self.kv.shape[-2]
        if self.num_cached + n > capacity:  # grow geometrically: amortised O(1) per row
            grown = kv.new_empty(kv.shape[:-2] + (max(64, 2 * (self.num_cached + n)), kv.shape[-1]))
            if self.kv is not None:
                grown[..., :self.num_cached, :] = self.kv[..., :self.num_cached, :]
            self.kv = grown
        self.kv[..., self.num_cached:self.num_cached + n, :] = kv
        self.num_cached += n


class ARDrafter:
    """Drafts with an autoregressive feature model (implements `FeatureDrafter`)."""

    def __init__(self, model: ARDraftModel, target: TargetModel, device: str | torch.device | None = None,
                 seed: int = 0, name: str | None = None) -> None:
        self.device = torch.device(device) if device is not None else target.device
        self.model = model.to(self.device).eval()
        self.name = name or model.config.model_type
        hf = target.model
        self.model.attach_target(hf.get_input_embeddings().weight, hf.get_output_embeddings().weight)
        if self.device.type == "cpu":  # few rows per GEMM: the kernels measured fastest here (draft_gemm.py)
            self.model.plan_gemm(cache_dir())
        self.hidden_layers: tuple[int, ...] = tuple(model.config.target_layers)
        self.block_size = model.config.block_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._states: dict[str, _RequestState] = {}

    @classmethod
    def from_pretrained(cls, model_class: type[ARDraftModel], path: str | Path, target: TargetModel,
                        device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                        seed: int = 0) -> ARDrafter:
        """Load a checkpoint folder of `model_class` and attach it to `target` (its device/dtype by default)."""
        dev = device if device is not None else target.device
        model = model_class.from_pretrained(path, device=dev, dtype=dtype or target.dtype)
        target_signature.check(model.config, target.model.config, path)  # another target: refused, with why
        return cls(model, target, dev, seed)

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        """Store the features (n, taps*D_t) of the request's next n positions until the next propose."""
        if features.shape[0] == 0:
            return
        state = self._states.setdefault(request_id, _RequestState())
        # a copy: the caller may reuse its buffer, and a view would keep the whole step's features alive
        state.pending.append(features.detach().to(self.device, copy=True))
        state.num_observed += features.shape[0]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        """Draft min(max_num_tokens, γ) tokens per request: one batched pass, then γ-1 one-token steps."""
        num_tokens = min(max_num_tokens, self.block_size)
        if not requests or num_tokens <= 0:
            return DraftOutput(tokens=[[] for _ in requests])
        states = [self._state_of(r) for r in requests]
        num_req = len(requests)
        pending = [torch.cat(s.pending) for s in states]  # (P_r, taps*D_t)
        num_pending = max(p.shape[0] for p in pending)
        features = pending[0].new_zeros(num_req, num_pending, pending[0].shape[-1])
        pending_ids = torch.zeros(num_req, num_pending, dtype=torch.long)
        for r, (req, state, feats) in enumerate(zip(requests, states, pending)):
            features[r, :feats.shape[0]] = feats
            # position j pairs with token x_{j+1}; the last pending position pairs with the anchor
            pending_ids[r, :feats.shape[0]] = torch.tensor(req.token_ids[state.num_cached + 1:])
        past_kv = self._padded_past(states)
        block = self.model.draft(
            past_kv, torch.tensor([s.num_cached for s in states], device=self.device), features,
            pending_ids.to(self.device), torch.tensor([p.shape[0] for p in pending], device=self.device),
            self._temperatures(requests), num_tokens, self.generator)
        for r, (state, feats) in enumerate(zip(states, pending)):
            n = feats.shape[0]
            if n > 1:
                state.append_kv(block.new_kv[:, r, :, :n - 1])
            state.pending = [feats[n - 1:]]  # the anchor's predecessor runs again next round

        target_ids = self.model.draft_to_target[block.draft_ids]  # (R, k)
        probs = None
        if block.probs is not None:
            full = block.probs.new_zeros(block.probs.shape[:2] + (self.model.config.target_vocab_size,))
            full[..., self.model.draft_to_target] = block.probs  # (R, k, V_t): 0 outside the draft vocab
            probs = list(full.float().unbind(0))
        return DraftOutput(tokens=target_ids.tolist(), probs=probs)

    def _state_of(self, request: DraftRequest) -> _RequestState:
        state = self._states.get(request.request_id)
        expected = len(request.token_ids) - 1
        if state is None or state.num_observed != expected:
            have = 0 if state is None else state.num_observed
            raise ValueError(f"request {request.request_id!r}: observed features of {have} tokens, but the "
                             f"anchor needs exactly the {expected} tokens before it")
        return state

    def _padded_past(self, states: list[_RequestState]) -> torch.Tensor | None:
        """(2, R, Hkv, Lp, hd) cached K/V padded to the longest; None when nothing is cached yet."""
        longest = max(s.num_cached for s in states)
        if longest == 0:
            return None
        template = next(s.kv for s in states if s.kv is not None)
        if len(states) == 1:
            return template[:, None, :, :longest]
        past = template.new_zeros(2, len(states), template.shape[1], longest, template.shape[-1])
        for r, s in enumerate(states):
            if s.num_cached:
                past[:, r, :, :s.num_cached] = s.kv[..., :s.num_cached, :]
        return past

    def _temperatures(self, requests: list[DraftRequest]) -> torch.Tensor | None:
        if not any(r.temperature > 0 for r in requests):
            return None
        return torch.tensor([r.temperature for r in requests], device=self.device)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
