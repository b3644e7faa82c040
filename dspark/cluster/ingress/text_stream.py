"""A request's outputs as text: incremental deltas, cut before the first stop string, logprobs in the
OpenAI formats, usage and speculation stats."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from dspark.cluster.ingress.api_models import SpecStats, Usage
from dspark.spec.logprobs import TokenLogprob
from dspark.verify_service.request import RequestOutput


@dataclass
class TextStream:
    """Turns a request's outputs into text: incremental deltas, cut before the first stop string.

    Decodes all output ids each time and sends the new suffix; holds back a trailing '\\ufffd'
    (half a multi-byte character) and any tail that may be the start of a stop string.
    """

    tokenizer: Any
    stops: list[str]
    token_ids: list[int] = field(default_factory=list)
    num_steps: int = 0
    num_verified: int = 0
    num_accepted: int = 0
    num_sent_chars: int = 0
    is_stopped: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_sent_logprobs: int = 0

    def add(self, out: RequestOutput) -> None:
        # new_token_ids is the step's own list; output_ids aliases the engine's live list
        self.token_ids += out.new_token_ids
        if out.new_logprobs:
            self.logprobs += out.new_logprobs
        self.num_steps = max(self.num_steps, out.num_steps)  # the engine's count: a message may merge several steps
        self.num_verified, self.num_accepted = out.num_verified, out.num_accepted
        if out.is_finished:
            self.finish_reason = out.finish_reason.value if out.finish_reason else "stop"

    def delta(self) -> str:
        if self.is_stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._first_stop(text)
        if cut is not None:
            self.is_stopped = True
            end = cut
        elif self.finish_reason is not None:
            end = len(text)
        else:
            end = len(text) - self._num_held_back(text)
        new = text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return new

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops if s) if i >= 0]
        return min(hits) if hits else None

    def _num_held_back(self, text: str) -> int:
        held = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def new_logprobs(self) -> list[TokenLogprob]:
        """Entries not yet sent (streaming: each chunk carries those of the tokens it brought)."""
        new = self.logprobs[self.num_sent_logprobs:]
        self.num_sent_logprobs = len(self.logprobs)
        return new

    def completion_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens = [self.tokenizer.decode([e.token_id]) for e in entries]
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def chat_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The chat format: {'content': [{token, logprob, bytes, top_logprobs: [...]}]}."""
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def usage(self, num_prompt_tokens: int) -> Usage:
        num = len(self.token_ids)
        return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num,
                     total_tokens=num_prompt_tokens + num)

    def spec_stats(self) -> SpecStats:
        return SpecStats(num_steps=self.num_steps,
                         mean_tokens_per_step=len(self.token_ids) / max(self.num_steps, 1),
                         num_verified=self.num_verified, num_accepted=self.num_accepted)
