"""Commit: append each request's accepted drafts and its next token, roll the cache back to what was
accepted (by length: rejected positions are simply not counted), apply the stop conditions, and tell the
acceptance tracker and a drafter that tracks its sources what happened."""

from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from dspark.models.drafters.base import Drafter, DraftOutput
from dspark.models.target.kv_cache import SlotPool
from dspark.spec.survival import AcceptanceTracker
from dspark.verify_service.request import Request, RequestOutput
from dspark.verify_service.step.stopping import append_with_stops


def commit(active: list[Request], draft: DraftOutput, lengths: list[int], accepted: list[int],
           next_tokens: list[int], cache: SlotPool, tracker: AcceptanceTracker, drafter: Drafter | None,
           eos_ids: list[int], tokenizer: PreTrainedTokenizerBase) -> list[RequestOutput]:
    tracker.update(lengths, accepted)
    feedback = getattr(drafter, "feedback", None)  # drafters that track acceptance per source
    if feedback is not None and any(draft.tokens):  # a round that verified none of its drafts is a verdict too
        feedback([r.request_id for r in active], lengths, accepted)
    outputs = []
    for req, d, n_ver, n_acc, tok in zip(active, draft.tokens, lengths, accepted, next_tokens):
        req.num_steps += 1
        req.num_drafted += len(d)
        req.num_verified += n_ver
        req.num_accepted += n_acc
        req.num_cached += 1 + n_acc  # rejected positions are rolled back by not counting them
        cache.lengths[req.slot] = req.num_cached
        outputs.append(emit(req, d[:n_acc] + [tok], eos_ids, tokenizer))
    return outputs


def emit(req: Request, tokens: list[int], eos_ids: list[int], tokenizer: PreTrainedTokenizerBase) -> RequestOutput:
    """Append `tokens` to the request (up to a stop) and say what the caller streams."""
    kept = append_with_stops(req, tokens, eos_ids, tokenizer)
    if req.is_finished:
        req.finish_s = time.perf_counter()
    # the whole output only on the last one: a growing copy every step is O(n²) bytes over Ray
    done = req.is_finished
    logprobs = None
    if req.params.logprobs is not None:
        logprobs, req.pending_logprobs = req.pending_logprobs[:len(kept)], []
    return RequestOutput(req.request_id, kept, list(req.output_ids) if done else [], done,
                         req.finish_reason, len(req.prompt_ids), req.num_verified, req.num_accepted, logprobs,
                         num_steps=req.num_steps + 1)  # the rounds so far and the prefill
