"""Log-probabilities of emitted tokens under the TARGET's own distribution.

Reported as OpenAI does: log_softmax of the target's raw logits (fp32, before temperature and top-p),
at the emitted token, plus the `num_top` most likely alternatives. Under speculation the rows are the
verify step's own target rows (accepted draft k was checked against row k, the final token comes from
row n), so the values are exactly what target-only decoding would report: drafts never enter them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """One entry per (row, token): logits (N, V) any dtype; rows index into it."""
    if not rows:
        return []
    logp = torch.log_softmax(logits[torch.tensor(rows)].float(), dim=-1)  # (n, V)
    chosen = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in rows]
    if num_top > 0:
        values, index = logp.topk(num_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]
