"""Oracle drafter: replays the target's own greedy continuation (benchmark ceilings only)."""

from __future__ import annotations

import torch

from dspark.models.drafters.base import DraftOutput, DraftRequest
from dspark.models.target.loader import TargetModel


class OracleDrafter:
    """Drafts what the target itself would say greedily; at T=0 every draft token is accepted.

    The continuation is computed with HF `generate` on the target, once per prompt: `prepare()` lets a
    benchmark do that before timing; otherwise it happens at the request's first draft. When the
    sequence leaves the stored continuation (sampling), the oracle proposes nothing.
    """

    name = "oracle"

    def __init__(self, target: TargetModel, max_new_tokens: int = 512) -> None:
        self.target = target
        self.max_new_tokens = max_new_tokens
        self._continuations: dict[tuple[int, ...], list[int]] = {}
        self._by_request: dict[str, list[int]] = {}

    @torch.inference_mode()
    def prepare(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> list[int]:
        key = tuple(prompt_ids)
        if key not in self._continuations:
            ids = torch.tensor([prompt_ids], device=self.target.device)
            out = self.target.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=max_new_tokens or self.max_new_tokens, pad_token_id=self.target.eos_token_ids[0]
                if self.target.eos_token_ids else 0)
            self._continuations[key] = out[0].tolist()
        return self._continuations[key]

    def set_continuation(self, prompt_ids: list[int], full_ids: list[int]) -> None:
        """Register the target's greedy sequence (prompt + continuation) computed elsewhere."""
        self._continuations[tuple(prompt_ids)] = list(full_ids)

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        tokens = []
        for r in requests:
            full = self._by_request.get(r.request_id)
            n = len(r.token_ids)
            if full is None:
                full = next((f for f in self._continuations.values() if f[:n] == r.token_ids), None)
                full = full or self.prepare(r.token_ids)
                self._by_request[r.request_id] = full
            tokens.append(full[n:n + max_num_tokens] if full[:n] == r.token_ids else [])
        return DraftOutput(tokens=tokens)

    def release(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)
