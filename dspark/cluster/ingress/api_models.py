"""OpenAI-compatible request and response bodies for /v1/completions and /v1/chat/completions.

Requests ignore unknown fields: OpenAI clients send many (user, stream_options, metadata, ...) that
change nothing about the output. An OpenAI field that WOULD change it and that we do not implement
(penalties, logit_bias, tools, a JSON response_format, echo, best_of, ...) is a 400 when set
to anything but its neutral value, never silently ignored. Fields we do read are validated here, so a
bad value is a 400 before the engine sees it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dspark.verify_service.request import MAX_LOGPROBS, SamplingParams

DEFAULT_MAX_TOKENS = 128


def _is_neutral_response_format(value: object) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") in (None, "text"))


# OpenAI request fields that change the output, and the test for "set to its neutral value"
UNSUPPORTED_FIELDS: dict[str, object] = {
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "function_call": lambda v: v in (None, "none"),
    "response_format": _is_neutral_response_format,
    "min_tokens": lambda v: v in (None, 0),
    "top_k": lambda v: v in (None, 0, -1),
}


class _SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints."""

    # extra fields are kept (not validated) only to refuse the unsupported ones by name
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingFields:
        extra = self.model_extra or {}
        set_fields = [name for name, is_neutral in UNSUPPORTED_FIELDS.items()
                      if name in extra and not is_neutral(extra[name])]  # type: ignore[operator]
        if set_fields:
            raise ValueError(f"not supported by this server: {', '.join(set_fields)} (leave unset)")
        return self

    model: str | None = Field(None, description="Served model name; omitted means the one served here.")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    # torch.Generator.manual_seed rejects seeds outside 64 bits
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed for reproducible sampling.")
    stop: str | list[str] | None = Field(None, description="Stop strings; the text ends before the first.")
    stream: bool = Field(False, description="Stream server-sent events instead of one JSON body.")
    n: int = Field(1, description="Number of choices; only 1 is supported.")
    ignore_eos: bool = Field(False, description="dspark extension: keep generating past EOS.")

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported (got n={n})")
        return n

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _default_max_tokens(cls, value: object) -> object:
        # clients send an explicit null to mean "server default"
        return DEFAULT_MAX_TOKENS if value is None else value

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _null_is_default(cls, value: object) -> object:
        return 1.0 if value is None else value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, stop=self.stop_list(), ignore_eos=self.ignore_eos)


class CompletionRequest(_SamplingFields):
    """Body of POST /v1/completions."""

    prompt: str | list[int] = Field(..., description="Prompt text, or prompt token ids.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Report the target's logprob of "
                                 "each token and this many most likely alternatives (legacy completions format).")

    def sampling_params(self) -> SamplingParams:
        params = super().sampling_params()
        params.logprobs = self.logprobs
        return params


class ChatMessage(BaseModel):
    """One message of a chat conversation."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"] = Field(..., description="Who wrote the message.")
    content: str = Field(..., description="The message text.")


class ChatCompletionRequest(_SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Newer OpenAI name for max_tokens; wins when both are given.")
    logprobs: bool | None = Field(None, description="Report the target's logprob of each output token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="With logprobs: this many most likely alternatives per token.")

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def sampling_params(self) -> SamplingParams:
        params = super().sampling_params()
        if self.max_completion_tokens is not None:
            params.max_tokens = self.max_completion_tokens
        if self.logprobs:
            params.logprobs = self.top_logprobs or 0
        return params


# ---- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int = Field(..., description="Tokens in the prompt (after the chat template).")
    completion_tokens: int = Field(..., description="Tokens generated.")
    total_tokens: int = Field(..., description="prompt_tokens + completion_tokens.")


class SpecStats(BaseModel):
    """dspark extension: how speculation went for this request."""

    num_steps: int = Field(..., description="Engine steps that gave this request tokens (prefill counts).")
    mean_tokens_per_step: float = Field(..., description="completion_tokens / num_steps.")
    num_verified: int = Field(0, description="Draft tokens sent to verification for this request.")
    num_accepted: int = Field(0, description="Of those, tokens accepted.")


def _created() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionChoice(BaseModel):
    """One generated text of a completion."""

    index: int = Field(0, description="Choice index (always 0: n=1).")
    text: str = Field(..., description="Generated text, cut before a matched stop string.")
    logprobs: dict[str, Any] | None = Field(None, description="With `logprobs`: tokens, token_logprobs, "
                                            "top_logprobs, text_offset (the target's, at the emitted tokens).")
    finish_reason: str | None = Field(None, description="'stop', 'length', or null while streaming.")


class CompletionResponse(BaseModel):
    """Body returned by POST /v1/completions (non-streaming)."""

    id: str = Field(default_factory=lambda: new_id("cmpl"), description="Request id.")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created, description="Unix time of creation.")
    model: str = Field(..., description="Served model name.")
    choices: list[CompletionChoice] = Field(..., description="Exactly one choice.")
    usage: Usage = Field(..., description="Token counts.")
    dspark: SpecStats | None = Field(None, description="Speculative decoding statistics.")


class CompletionChunk(BaseModel):
    """One server-sent event of a streaming completion; the last one has finish_reason and usage."""

    id: str = Field(..., description="Request id, the same in every chunk.")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(..., description="Unix time of creation.")
    model: str = Field(..., description="Served model name.")
    choices: list[CompletionChoice] = Field(..., description="Exactly one choice with the new text.")
    usage: Usage | None = Field(None, description="Set on the last chunk only.")
    dspark: SpecStats | None = Field(None, description="Set on the last chunk only.")


class ChatResponseMessage(BaseModel):
    """The assistant's reply."""

    role: Literal["assistant"] = "assistant"
    content: str = Field(..., description="Reply text.")


class ChatChoice(BaseModel):
    """One reply of a chat completion."""

    index: int = Field(0, description="Choice index (always 0: n=1).")
    message: ChatResponseMessage = Field(..., description="The reply.")
    logprobs: dict[str, Any] | None = Field(None, description="With `logprobs`: {'content': [...]} per token.")
    finish_reason: str | None = Field(None, description="'stop' or 'length'.")


class ChatCompletionResponse(BaseModel):
    """Body returned by POST /v1/chat/completions (non-streaming)."""

    id: str = Field(default_factory=lambda: new_id("chatcmpl"), description="Request id.")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created, description="Unix time of creation.")
    model: str = Field(..., description="Served model name.")
    choices: list[ChatChoice] = Field(..., description="Exactly one choice.")
    usage: Usage = Field(..., description="Token counts.")
    dspark: SpecStats | None = Field(None, description="Speculative decoding statistics.")


class ChatDelta(BaseModel):
    """What a streaming chat chunk adds to the reply."""

    role: Literal["assistant"] | None = Field(None, description="Set on the first chunk only.")
    content: str | None = Field(None, description="New reply text.")


class ChatChunkChoice(BaseModel):
    """The single choice of a streaming chat chunk."""

    index: int = Field(0, description="Choice index (always 0: n=1).")
    delta: ChatDelta = Field(..., description="New reply text.")
    logprobs: dict[str, Any] | None = Field(None, description="With `logprobs`: the chunk's tokens.")
    finish_reason: str | None = Field(None, description="Set on the last chunk only.")


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streaming chat completion; the last has finish_reason and usage."""

    id: str = Field(..., description="Request id, the same in every chunk.")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(..., description="Unix time of creation.")
    model: str = Field(..., description="Served model name.")
    choices: list[ChatChunkChoice] = Field(..., description="Exactly one choice with the delta.")
    usage: Usage | None = Field(None, description="Set on the last chunk only.")
    dspark: SpecStats | None = Field(None, description="Set on the last chunk only.")


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str = Field(..., description="Served model name, to pass as `model`.")
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created, description="Unix time the server started.")
    owned_by: str = Field("dspark", description="Owner label.")


class ModelList(BaseModel):
    """Body returned by GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(..., description="The models served here.")


class ErrorInfo(BaseModel):
    """What went wrong, OpenAI style."""

    message: str = Field(..., description="Human-readable reason.")
    type: str = Field("invalid_request_error", description="Error class.")
    param: str | None = Field(None, description="The offending field, where known.")
    code: str | None = Field(None, description="Machine-readable code, where known.")


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx answer."""

    error: ErrorInfo
