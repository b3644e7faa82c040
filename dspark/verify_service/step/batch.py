"""Assemble the flattened VerifyInput of one step from per-request drafts and lengths."""

from __future__ import annotations

import torch

from dspark.models.drafters.base import SparseQ
from dspark.spec.verification import VerifyInput
from dspark.verify_service.request import Request


def build_verify_input(target_logits: torch.Tensor, requests: list[Request], draft_tokens: list[list[int]],
                       draft_probs: list[torch.Tensor | SparseQ] | None, lengths: list[int]) -> VerifyInput:
    """Rows of request r: ℓ_r draft positions, then its bonus row (target_logits already in that order). Draft
    distributions, dense or `SparseQ`, are written for the verified positions only; bonus rows stay zero."""
    flat: list[int] = []
    for d, n in zip(draft_tokens, lengths):
        flat += d[:n] + [0]
    device = target_logits.device
    probs = None
    if draft_probs is not None:
        probs = torch.zeros(len(flat), target_logits.shape[-1], device=device)  # (T, V)
        offset = 0
        for p, n in zip(draft_probs, lengths):
            if n:
                if isinstance(p, SparseQ):
                    p.write(probs[offset:offset + n])
                else:
                    probs[offset:offset + n] = p[:n]
            offset += n + 1  # the bonus row: no draft
    return VerifyInput(
        target_logits=target_logits,
        draft_tokens=torch.tensor(flat, dtype=torch.long, device=device),
        draft_probs=probs,
        num_draft=list(lengths),
        temperature=[r.params.temperature for r in requests],
        top_p=[r.params.top_p for r in requests],
        generators=[r.generator for r in requests],
    )
