"""Assemble the flattened VerifyInput of one step from per-request drafts and lengths."""

from __future__ import annotations

import torch

from dspark.spec.verification import VerifyInput
from dspark.verify_service.request import Request


def build_verify_input(target_logits: torch.Tensor, requests: list[Request], draft_tokens: list[list[int]],
                       draft_probs: list[torch.Tensor] | None, lengths: list[int]) -> VerifyInput:
    """Rows of request r: ℓ_r draft positions, then its bonus row (target_logits already in that order)."""
    flat: list[int] = []
    for d, n in zip(draft_tokens, lengths):
        flat += d[:n] + [0]
    device = target_logits.device
    probs = None
    if draft_probs is not None:
        vocab = target_logits.shape[-1]
        rows = []
        for p, n in zip(draft_probs, lengths):
            rows.append(p[:n].to(device=device, dtype=torch.float32))
            rows.append(torch.zeros(1, vocab, device=device))  # bonus row: no draft
        probs = torch.cat(rows)  # (T, V)
    return VerifyInput(
        target_logits=target_logits,
        draft_tokens=torch.tensor(flat, dtype=torch.long, device=device),
        draft_probs=probs,
        num_draft=list(lengths),
        temperature=[r.params.temperature for r in requests],
        top_p=[r.params.top_p for r in requests],
        generators=[r.generator for r in requests],
    )
