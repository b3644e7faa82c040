"""Feed: after a round (or a prefill), a drafter that conditions on the target's hidden states gets the
features of exactly the tokens that stayed in the cache, in position order (`FeatureDrafter.observe`)."""

from __future__ import annotations

import torch

from dspark.models.drafters.base import Drafter
from dspark.models.target.layer import ForwardOutput
from dspark.verify_service.request import Request


def taps_of(out: ForwardOutput, hidden_layers: tuple[int, ...]) -> torch.Tensor:
    """The tapped layers' hidden states side by side: (T, taps*D)."""
    return torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1)


def feed_drafter(drafter: Drafter | None, hidden_layers: tuple[int, ...], reqs: list[Request],
                 chunk_lens: list[int], num_kept: list[int], out: ForwardOutput) -> None:
    """`chunk_lens`: the tokens each request had in the forward; `num_kept`: how many of them stay cached."""
    if not hidden_layers or drafter is None:
        return
    feats = taps_of(out, hidden_layers)  # (T, taps*D)
    offset = 0
    for req, n_chunk, n_keep in zip(reqs, chunk_lens, num_kept):
        # features of cache positions num_cached .. num_cached + n_keep - 1, in order
        drafter.observe(req.request_id, feats[offset:offset + n_keep])  # type: ignore[attr-defined]
        offset += n_chunk


def prompt_features(drafter: Drafter | None, hidden_layers: tuple[int, ...], reqs: list[Request],
                    starts: list[int], cached: list[torch.Tensor | None],
                    out: ForwardOutput) -> list[torch.Tensor | None]:
    """Each prompt's drafter features (len(prompt), F): the prefix cache's, then the computed ones."""
    if not hidden_layers or drafter is None:
        return [None] * len(reqs)
    feats = taps_of(out, hidden_layers)  # (T, taps*D)
    result: list[torch.Tensor | None] = []
    offset = 0
    for req, start, pre in zip(reqs, starts, cached):
        n = len(req.prompt_ids) - start
        mine = feats[offset:offset + n]
        result.append(mine if pre is None else torch.cat([pre, mine]))
        offset += n
    return result
