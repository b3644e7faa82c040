"""Per-request state inside the engine, and what the engine reports back for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from dspark.spec.logprobs import TokenLogprob

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # report the target's logprob of each token, and this many alternatives
    # whose text this request's output may join and draft from (the suffix proposer's served-text index):
    # the ingress sets a digest of the API key; "" = no key
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs (alternatives per token) must be in [0, {MAX_LOGPROBS}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def validate_request(prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int, max_model_len: int,
                     vocab_size: int) -> None:
    """Raise ValueError (a client error) if this request can never be served."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    need = len(prompt_ids) + params.max_tokens + num_draft_tokens + 1
    if need > max_model_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                         f"exceeds max_model_len={max_model_len}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")


class FinishReason(StrEnum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    micro_batch: int = 0  # which ping-pong half of the batch it steps with (pipelined engine)
    num_cached: int = 0  # tokens of prompt+output whose K/V are in the cache (all but the last)
    finish_reason: FinishReason | None = None
    stop_text_len: int | None = None  # text is cut here when a stop string matched
    num_steps: int = 0
    num_drafted: int = 0
    num_verified: int = 0
    num_accepted: int = 0
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens the step emits
    finish_s: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)


@dataclass
class RequestOutput:
    """Progress of one request after a step: the tokens it gained, and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    output_ids: list[int]  # every output token, on the finishing output only ([] before)
    is_finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_verified: int = 0  # draft tokens verified for this request so far
    num_accepted: int = 0  # of which accepted
    new_logprobs: list[TokenLogprob] | None = None  # aligned with new_token_ids, when asked for
    # engine steps that gave this request tokens so far, its prefill included: a message may merge several steps
    # (`stream_interval_ms`), so a stream's messages are not its steps
    num_steps: int = 0


@dataclass
class StepStats:
    """One engine step, for benchmarks and the `--json` output of `dspark generate`."""

    num_requests: int
    num_tokens: int  # B: tokens through the target this step
    lengths: list[int]  # ℓ_r scheduled per request
    num_accepted: list[int]
    draft_ms: float
    schedule_ms: float
    verify_ms: float
    confidences: list[list[float]] | None = None  # per request, as the drafter reported them
    micro_batch: int = 0
    start_s: float = 0.0  # wall clock, for timelines
    end_s: float = 0.0
    sources: list[str] | None = None  # per request, which source drafted it (multi-source drafters)
    num_proposals: dict[str, int] | None = None  # per source, proposals made this step (chosen or not)
