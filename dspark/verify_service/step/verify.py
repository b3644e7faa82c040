"""Verify: ONE flattened target forward over every request's last token and its ℓ_r drafts, then lossless
acceptance (accept x_k with probability min(1, p_t/p_d), left to right; at the first rejection sample from
norm(max(0, p_t − p_d)); if all pass, a bonus token from p_t)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from dspark.models.drafters.base import DraftOutput
from dspark.models.target.layer import ForwardOutput, SeqChunk
from dspark.models.target.runner import TargetRunner
from dspark.spec.logprobs import token_logprobs
from dspark.spec.nucleus import sample_nucleus
from dspark.spec.verification import verify, verify_greedy
from dspark.verify_service.request import Request
from dspark.verify_service.step.batch import build_verify_input


@dataclass
class Verified:
    """What a verify forward decided, and the forward itself (its hidden states feed the drafter)."""

    num_accepted: list[int]  # per request: leading drafts accepted, 0..ℓ_r
    next_token: list[int]  # per request: the token sampled after them (correction or bonus)
    out: ForwardOutput  # the round's own rows (riders' removed)
    rider_logits: torch.Tensor | None = None  # (N_riders, V): the prompts that rode in this forward
    rider_out: ForwardOutput | None = None  # the riders' logits and tapped hidden states (their tokens' rows)


def verify_round(runner: TargetRunner, active: list[Request], draft: DraftOutput, lengths: list[int],
                 hidden_layers: tuple[int, ...], riders: list[SeqChunk] | None = None) -> Verified:
    """`riders`: prompt chunks computed in the same forward, ahead of the round's own; their logits and
    hidden states are split off into `rider_logits` / `rider_out`."""
    chunks = [SeqChunk(r.slot, r.num_cached, [r.token_ids[-1]] + d[:n], n + 1)
              for r, d, n in zip(active, draft.tokens, lengths)]
    out = runner.forward((riders or []) + chunks, hidden_layers)
    rider_logits = rider_out = None
    if riders:
        num_rider_logits = sum(c.num_logits for c in riders)
        num_rider_rows = sum(len(c.token_ids) for c in riders)
        rider_logits = out.logits[:num_rider_logits]
        rider_out = ForwardOutput(rider_logits, {i: h[:num_rider_rows] for i, h in out.hidden_states.items()})
        out = ForwardOutput(out.logits[num_rider_logits:],
                            {i: h[num_rider_rows:] for i, h in out.hidden_states.items()})
    num_accepted, next_token = accept(active, draft, lengths, out.logits)
    if any(r.params.logprobs is not None for r in active):
        first_row = list(itertools.accumulate((n + 1 for n in lengths), initial=0))
        rows = [list(range(f, f + n + 1)) for f, n in zip(first_row, num_accepted)]  # accepted drafts, then last
        note_logprobs(active, out.logits, rows,
                      [d[:n] + [t] for d, n, t in zip(draft.tokens, num_accepted, next_token)])
    return Verified(num_accepted, next_token, out, rider_logits, rider_out)


def accept(active: list[Request], draft: DraftOutput, lengths: list[int],
           logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Lossless acceptance over the step's logits (rows: each request's ℓ_r drafts, then its bonus).

    On CPU, requests verifying nothing are sampled by `sample_plain` (also inside a step where others
    verify), so what a request draws from its generator never depends on its batch.
    """
    # all greedy: the verifier's argmax is what `sample_plain` gives a greedy request, one pass over all rows (on CPU
    # on host lists, `verify_greedy`: no small tensor ops)
    if logits.device.type == "cpu" and all(r.params.temperature == 0.0 for r in active):
        result = verify_greedy(logits, draft.tokens, lengths)
        return result.num_accepted, result.next_token
    plain = [i for i, n in enumerate(lengths) if n == 0]
    if logits.device.type != "cpu" or not plain:
        result = verify(build_verify_input(logits, active, draft.tokens, draft.probs, lengths))
        return result.num_accepted, result.next_token
    if len(plain) == len(active):  # a plain target step: nothing to verify, one sample per request
        return [0] * len(active), sample_plain(active, logits)
    first_row = list(itertools.accumulate((n + 1 for n in lengths), initial=0))
    drafted = [i for i, n in enumerate(lengths) if n > 0]
    rows = torch.tensor([r for i in drafted for r in range(first_row[i], first_row[i + 1])])
    probs = [draft.probs[i] for i in drafted] if draft.probs is not None else None
    result = verify(build_verify_input(logits[rows], [active[i] for i in drafted],
                                       [draft.tokens[i] for i in drafted], probs, [lengths[i] for i in drafted]))
    plain_tokens = sample_plain([active[i] for i in plain], logits[[first_row[i] for i in plain]])
    num_accepted, next_token = [0] * len(active), [0] * len(active)
    for i, n_acc, tok in zip(drafted, result.num_accepted, result.next_token):
        num_accepted[i], next_token[i] = n_acc, tok
    for i, tok in zip(plain, plain_tokens):
        next_token[i] = tok
    return num_accepted, next_token


def sample_plain(reqs: list[Request], logits: torch.Tensor) -> list[int]:
    """One token per request from its filtered target distribution (logits (R, V)).

    On CPU the sparse nucleus sampler (no (R, V) sort, noise only for candidates) costs ~40 ms at
    256 requests where the general verifier costs ~0.9 s; on GPUs the verifier's sort is cheap.
    """
    if logits.device.type == "cpu":
        return sample_nucleus(logits, [r.params.temperature for r in reqs], [r.params.top_p for r in reqs],
                              [r.generator for r in reqs])
    return verify(build_verify_input(logits, reqs, [[] for _ in reqs], None, [0] * len(reqs))).next_token


def note_logprobs(reqs: list[Request], logits: torch.Tensor, rows: list[list[int]],
                  tokens: list[list[int]]) -> None:
    """Target logprobs of the tokens this step emits, for the requests that asked (see spec/logprobs)."""
    for req, r_rows, r_tokens in zip(reqs, rows, tokens):
        if req.params.logprobs is not None:
            req.pending_logprobs = token_logprobs(logits, r_rows, r_tokens, req.params.logprobs)
