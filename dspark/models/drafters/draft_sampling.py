"""Drawing one draft token per request from logits, returning the distribution it was drawn from."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_draft_token(logits: torch.Tensor, is_greedy: torch.Tensor, inv_temp: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (R, N); is_greedy (R, 1) bool; inv_temp (R, 1); uniforms (R, 1) in [0, 1).

    Returns the token (R,) and the distribution q it was drawn from (R, N): softmax(logits · inv_temp)
    for sampled rows, a point mass on the argmax for greedy rows. The verifier's p/q acceptance rule is
    lossless only if q is exactly this distribution.
    """
    p = torch.softmax(logits * inv_temp, dim=-1)  # (R, N)
    # inverse-CDF sampling; right=True lands on a strict CDF jump, so a zero-probability token is never drawn
    cdf = p.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(-1).clamp_max(p.shape[-1] - 1)
    tok = torch.where(is_greedy[:, 0], logits.argmax(dim=-1), sampled)
    p = torch.where(is_greedy, F.one_hot(tok, p.shape[-1]).to(p.dtype), p)
    return tok, p
