"""Stop conditions: max_tokens, EOS, stop strings. Applied to the tokens a step emits."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from dspark.verify_service.request import FinishReason, Request


def append_with_stops(req: Request, new_tokens: list[int], eos_ids: list[int],
                      tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Append what may be appended of new_tokens to req.output_ids; set finish_reason. Returns them."""
    kept: list[int] = []
    for tok in new_tokens:
        if len(req.output_ids) + len(kept) >= req.params.max_tokens:
            req.finish_reason = FinishReason.LENGTH
            break
        if tok in eos_ids and not req.params.ignore_eos:
            req.finish_reason = FinishReason.STOP  # EOS itself is not part of the output
            break
        kept.append(tok)
    req.output_ids.extend(kept)
    if req.finish_reason is None and len(req.output_ids) >= req.params.max_tokens:
        req.finish_reason = FinishReason.LENGTH
    if req.params.stop and kept:
        text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
        # only the tail can hold a new match: the last step's tokens plus the longest stop string
        cut = _first_stop(text, req.params.stop)
        if cut is not None:
            req.stop_text_len = cut
            req.finish_reason = FinishReason.STOP
    return kept


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
