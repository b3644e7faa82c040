"""Prefill: newly admitted prompts, grouped into forwards."""

from __future__ import annotations

from dspark.verify_service.request import Request

# Prompts prefilled per forward: attention pads every prompt of a forward to the longest, so one
# forward over 256 prompts of ~60 tokens costs 2.6x what four forwards of 64 cost (SmolLM2, bf16).
MAX_PREFILL_REQUESTS = 64
MAX_PREFILL_TOKENS = 4096


def prefill_groups(reqs: list[Request], sizes: list[int] | None = None, max_requests: int = MAX_PREFILL_REQUESTS,
                   max_tokens: int = MAX_PREFILL_TOKENS) -> list[list[Request]]:
    """Consecutive runs of requests (newly admitted ones: their slots are contiguous) within both caps, one
    forward each; `sizes`: the tokens each brings (default: its prompt)."""
    groups: list[list[Request]] = [[]]
    num_tokens = 0
    for req, n in zip(reqs, sizes if sizes is not None else [len(r.prompt_ids) for r in reqs]):
        if groups[-1] and (len(groups[-1]) >= max_requests or num_tokens + n > max_tokens):
            groups.append([])
            num_tokens = 0
        groups[-1].append(req)
        num_tokens += n
    return groups
