"""The OpenAI-compatible HTTP front: /v1/models, /v1/completions, /v1/chat/completions, /health.

The app talks to any engine with an AsyncEngine-shaped `generate()` and a `tokenizer`, fetched per
request through `get_engine`, so a distributed engine can replace the in-process one unchanged.
Client mistakes are always 4xx with an OpenAI-style `{"error": {...}}` body; a dead engine is a 503
with `Retry-After`, overload a 429 with `Retry-After` (see `admission.py`), and so is a pool still warming up:
`/v1/models` and `/health` answer 200 only when a chat would be answered (`readiness.py`). Every request has an id
(`x-request-id`); what went wrong inside is logged under it, and error bodies carry only the id, never
a traceback, an address or a path. Bearer keys guard every route (`access.py`); the operator routes
(`/v1/dspark/stats`) need an admin key.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.cluster.ab import ARM_HEADER, OVERRIDE_HEADER, SESSION_HEADER, Arm, chosen_arm
from dspark.cluster.access import KeyRing, presented_digest
from dspark.cluster.admission import Admission, Mode
from dspark.cluster.admission_gate import MODE_HEADER, AdmissionGate, Refusal
from dspark.cluster.api_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SpecStats,
    Usage,
    new_id,
)
from dspark.cluster.latency_model import LatencyModel
from dspark.cluster.metrics import Metrics
from dspark.cluster.quota_board import start_settling
from dspark.cluster.quotas import QuotaBook
from dspark.cluster.readiness import RETRY_AFTER_S
from dspark.spec.logprobs import TokenLogprob
from dspark.verify_service.async_engine import EngineDeadError
from dspark.verify_service.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class GenerateEngine(Protocol):
    """What the HTTP layer needs from an engine (AsyncEngine satisfies it)."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def is_alive(self) -> bool: ...

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]: ...


ADMIN_PATHS = ("/v1/dspark/stats", "/metrics")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_BODY_BYTES = 1 << 20


class ApiError(Exception):
    """An error answered with `status` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = headers or {}


def error_response(status: int, info: ErrorInfo, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def _request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or "unknown"


class GuardMiddleware:
    """Raw ASGI: assigns the request id, checks the bearer key and the body size before any routing.

    Bodies larger than `max_body_bytes` are a 413, whether they announce it (Content-Length) or not
    (chunked: the count stops the read at the limit)."""

    def __init__(self, app: Any, keys: KeyRing, max_body_bytes: int, metrics: Metrics | None = None,
                 gate: AdmissionGate | None = None, cluster_name: str = "dspark") -> None:
        self.app, self.keys, self.max_body_bytes, self.metrics = app, keys, max_body_bytes, metrics
        self.gate = gate  # admission and quotas: a key over its quota, or every arm full, is refused here
        self.cluster_name = cluster_name
        self._settling: Any = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        # behind Serve's proxy the request already has an id, which the proxy also puts on the response:
        # use that one (one id in logs and headers, one header); standalone, make one and send it
        incoming = headers.get("x-request-id", "")
        has_id = bool(re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", incoming))
        rid = incoming if has_id else uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        is_generate = scope.get("path", "") in GENERATE_PATHS
        gate = self.gate if is_generate else None
        quota_headers: dict[str, str] = {}
        mode: Mode | None = None

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                if not has_id:
                    message.setdefault("headers", []).append((b"x-request-id", rid.encode()))
                if gate is not None:  # what the front door refuses by, and the key's rate-limit state
                    message.setdefault("headers", []).extend(
                        gate.published_headers(mode)
                        + [(k.encode(), v.encode()) for k, v in quota_headers.items()])
                if message.get("status", 200) >= 400 and self.metrics is not None:
                    self.metrics.inc("dspark_request_errors_total", status=str(message["status"]))
            await send(message)

        access = self.keys.access_of(headers.get("authorization"))
        if access is None:
            await _send_error(send_with_id, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                              "authentication_error", {"WWW-Authenticate": "Bearer"})
            return
        scope["state"]["access"] = access
        if scope.get("path", "") in ADMIN_PATHS and access != "admin":
            await _send_error(send_with_id, 403, "this route needs an admin API key", "permission_error")
            return
        if headers.get(MODE_HEADER) in ("sla", "static") and access == "admin":
            mode = headers[MODE_HEADER]  # type: ignore[assignment]
        scope["state"]["admission_mode"] = mode
        if gate is not None:
            if gate.quotas is not None and gate.quotas.is_enabled and self._settling is None:
                self._settling = start_settling(gate.quotas, self.cluster_name) or False
            digest = presented_digest(headers.get("authorization")) if gate.quotas is not None else None
            scope["state"]["key_digest"] = digest
            # a key over its quota, or every arm at its limit (whichever arm this request would get, it
            # would be refused): refused now, before reading or parsing the body, the cheapest refusal here
            refusal, quota_headers = gate.precheck(digest, mode)
            if refusal is not None:
                await _send_error(send_with_id, refusal.status, refusal.message, refusal.type_, refusal.headers,
                                  refusal.code)
                return
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            await _send_error(send_with_id, 400, "invalid Content-Length header")
            return
        if length > self.max_body_bytes:
            await _send_error(send_with_id, 413, f"request body over {self.max_body_bytes} bytes")
            return
        # read the body here, at most max_body_bytes + one message, then replay it to the app
        chunks: list[bytes] = []
        size = 0
        more = scope.get("method", "GET") not in ("GET", "HEAD")
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                await _send_error(send_with_id, 413, f"request body over {self.max_body_bytes} bytes")
                return
        body = b"".join(chunks)
        replayed = [False]

        async def replay() -> dict:
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send_with_id)


async def _send_error(send: Callable, status: int, message: str, type_: str = "invalid_request_error",
                      headers: dict[str, str] | None = None, code: str | None = None) -> None:
    body = json.dumps(ErrorResponse(error=ErrorInfo(message=message, type=type_, code=code)).model_dump()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return f"malformed JSON body: {detail}".rstrip(": "), None
    parts, params = [], []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        params.append(".".join(loc))
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts), (params[0] or None) if params else None


def install_error_handlers(app: FastAPI) -> None:
    """Map every failure to an OpenAI-style body; client errors are 400, never 422 or 5xx."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, ErrorInfo(message=message, param=param))

    @app.exception_handler(ApiError)
    async def _on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.info, exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        rid = _request_id(request)
        log.error("request %s: engine unavailable: %s", rid, exc)
        return error_response(503, ErrorInfo(message=f"the engine is unavailable; retry later (request id {rid})",
                                             type="service_unavailable_error"), {"Retry-After": "5"})

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, ErrorInfo(message=str(exc.detail)))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = _request_id(request)
        log.error("request %s failed", rid, exc_info=exc)  # the details stay in the server's log
        return error_response(500, ErrorInfo(message=f"internal error (request id {rid})", type="server_error"))


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
        self.num_steps += bool(out.new_token_ids)
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


async def _start(engine: GenerateEngine, prompt_ids: list[int], params: SamplingParams
                 ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
    """Submit the request and wait for its first output, so a rejected request is still a 400."""
    gen = engine.generate(prompt_ids, params)
    try:
        first = await anext(gen)
    except ValueError as exc:
        await gen.aclose()
        raise ApiError(400, str(exc)) from exc
    except BaseException:
        await gen.aclose()
        raise
    return gen, first


class _released:  # noqa: N801 - used like the generator it wraps
    """The engine's output stream holding an admission ticket, given back exactly once on close
    (an async generator that never started would skip its `finally`, and leak the ticket)."""

    def __init__(self, gen: Any, on_close: Callable[[], None] | None) -> None:
        self.gen, self.on_close, self.is_closed = gen, on_close, False

    def __aiter__(self) -> _released:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await anext(self.gen)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        try:
            await self.gen.aclose()
        finally:
            if self.on_close is not None:
                self.on_close()


async def _outputs(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if first.is_finished:
        return
    async for out in gen:
        yield out


def _encode_chat(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    messages = [m.model_dump() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except (ValueError, jinja2.TemplateError) as exc:  # no template, or it rejects the conversation
        raise ApiError(400, f"chat template: {exc}", param="messages") from exc
    # the template already wrote any BOS/role tokens it wants
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def _is_ready(engine: GenerateEngine) -> bool:
    """An engine that can be warming (the Serve pools') says whether it would answer now; others always would."""
    probe = getattr(engine, "is_ready", None)
    return True if probe is None else bool(await probe())


def _refused(refusal: Refusal) -> ApiError:
    return ApiError(refusal.status, refusal.message, type_=refusal.type_, code=refusal.code, headers=refusal.headers)


def _warming_up() -> ApiError:
    return ApiError(503, "the model is warming up (loading on its workers); retry shortly",
                    type_="service_unavailable_error", code="warming_up",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _encode_prompt(tokenizer: Any, body: CompletionRequest) -> list[int]:
    if isinstance(body.prompt, str):
        return tokenizer(body.prompt)["input_ids"]
    return list(body.prompt)


def build_fastapi(get_engine: Callable[[], GenerateEngine], model_name: str, keys: KeyRing | None = None,
                  admission: Admission | dict[str, Admission] | None = None,
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                  arm_engines: dict[str, Callable[[], GenerateEngine]] | None = None,
                  arms: list[Arm] | None = None, request_log: Path | None = None,
                  metrics: dict[str, Metrics] | None = None,
                  metrics_text: Callable[[], str] | None = None, quotas: QuotaBook | None = None,
                  cluster_name: str = "dspark") -> FastAPI:
    """The OpenAI-compatible app serving `model_name` from the engine `get_engine()` returns.

    With `arms` (A/B): each request goes to `arm_engines[arm]()` for the arm `ab.chosen_arm` picks, the
    response names it in `x-dspark-arm`, and `request_log` (JSONL) gets one record per finished request
    for `dspark ab report`. `metrics`: per arm ("default" without arms), the request metrics' handles;
    `metrics_text()`: the Prometheus text `GET /metrics` serves (see metrics_export.py). `admission`: per arm
    (admission.py); `quotas`: per-key buckets (quotas.py), settled through the `<cluster_name>-quotas` actor."""
    app = FastAPI(title="dspark", description="OpenAI-compatible speculative decoding server")
    install_error_handlers(app)
    any_arm = next(iter(metrics.values()), None) if metrics else None
    guard_metrics = (Metrics(any_arm.labels["model_name"], "any", "ingress", any_arm.labels["replica"])
                     if any_arm is not None else None)
    admissions = (dict(admission) if isinstance(admission, dict) else {arms[0].name if arms else "default": admission}
                  if admission else {})
    gate = AdmissionGate(admissions, quotas, metrics) if admissions or quotas else None
    app.state.admission_gate = gate
    app.add_middleware(GuardMiddleware, keys=keys or KeyRing(), max_body_bytes=max_body_bytes, metrics=guard_metrics,
                       gate=gate, cluster_name=cluster_name)
    started = int(time.time())

    def check_model(body_model: str | None) -> None:
        if body_model is not None and body_model != model_name:
            raise ApiError(404, f"model {body_model!r} is not served here; use {model_name!r}",
                           param="model", code="model_not_found")

    arm_list = arms or [Arm("default", 1.0)]
    log_file = open(request_log, "a", buffering=1) if request_log is not None else None  # noqa: SIM115

    def pick_arm(body: Any, request: Request) -> str:
        state = request.scope.get("state", {})
        user = (body.model_extra or {}).get("user")
        try:
            return chosen_arm(arm_list, str(user) if user else None, request.headers.get(SESSION_HEADER),
                              _request_id(request), request.headers.get(OVERRIDE_HEADER),
                              state.get("access") == "admin")
        except ValueError as exc:
            raise ApiError(400, str(exc), param=OVERRIDE_HEADER) from exc

    async def begin(body: Any, encode: Any, request: Request) -> tuple[list[int], TextStream, Any, RequestOutput,
                                                                         _RequestRecord]:
        """Admit, pick the arm, validate the model name, encode, submit, and wait for the first output
        (errors → 4xx). The admission ticket is held by the returned generator: closing it (end, error,
        client gone) gives it back."""
        check_model(body.model)
        arm = pick_arm(body, request)
        engine = arm_engines[arm]() if arm_engines else get_engine()
        if not await _is_ready(engine):  # warming up: say when to come back, queue nothing
            raise _warming_up()
        state = request.scope.get("state", {})
        adm = admissions.get(arm) if admissions else None  # per arm: admitted by predicted latency
        if gate is not None and adm is not None:
            refusal = gate.enter(arm, state.get("admission_mode"), getattr(engine, "num_verify_replicas", None))
            if refusal is not None:
                raise _refused(refusal)
        num_in_flight = adm.num_in_flight if adm is not None else 0
        record = _RequestRecord(arm, _request_id(request), time.time(), time.perf_counter(), log_file,
                                metrics.get(arm) if metrics else None)
        digest = state.get("key_digest")
        if quotas is not None and digest:
            record.charge = lambda n: quotas.charge_tokens(digest, n)
        try:
            prompt_ids = encode(engine.tokenizer, body)
            stream = TextStream(engine.tokenizer, body.stop_list())
            params = body.sampling_params()
            params.tenant = digest or ""  # the suffix proposer's served text stays within the key
            gen, first = await _start(engine, prompt_ids, params)
        except BaseException:
            if adm is not None:
                adm.leave()
            raise
        record.first_s = record.last_s = time.perf_counter()
        record.num_prompt_tokens = len(prompt_ids)
        if adm is None:
            return prompt_ids, stream, _released(gen, None), first, record
        adm.model.first_token(record.first_s - record.start_s, num_in_flight)  # itself included
        record.model = adm.model

        def closed() -> None:
            adm.leave()
            adm.model.finished(record.last_s - record.first_s, was_decoding=True)

        return prompt_ids, stream, _released(gen, closed), first, record

    async def check_ready() -> None:
        """503 unless every arm would answer a chat now (the engine loop runs, the pool answered its probe)."""
        engines = [f() for f in arm_engines.values()] if arm_engines else [get_engine()]
        if not all(e.is_alive for e in engines):
            raise ApiError(503, "engine loop is not running", type_="service_unavailable_error", code="engine_dead",
                           headers={"Retry-After": "5"})
        if not all(await asyncio.gather(*(_is_ready(e) for e in engines))):
            raise _warming_up()

    @app.get("/health")
    async def health() -> dict[str, str]:
        await check_ready()
        return {"status": "ok"}

    @app.get("/v1/dspark/stats")
    def dspark_stats() -> dict[str, Any]:  # sync: gathering worker stats blocks, so FastAPI threads it
        stats = getattr(get_engine(), "stats", None)
        if not callable(stats):
            raise ApiError(404, "this deployment has no worker pools (mode: inline)", code="no_stats")
        return stats()

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus_metrics() -> PlainTextResponse:  # sync: it reads the nodes' metrics agents
        if metrics_text is None:
            raise ApiError(404, "metrics are not exported by this server", code="no_metrics")
        return PlainTextResponse(metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        await check_ready()  # listed = servable: a client that sees the model can use it
        return ModelList(data=[ModelCard(id=model_name, created=started)])

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request,
                          response: Response) -> CompletionResponse | StreamingResponse:
        prompt_ids, stream, gen, first, record = await begin(body, _encode_prompt, request)
        response.headers[ARM_HEADER] = record.arm
        rid, created = new_id("cmpl"), int(time.time())

        wants_logprobs = body.logprobs is not None

        def chunk(text: str, is_last: bool) -> str:
            lp = stream.completion_logprobs(stream.new_logprobs()) if wants_logprobs else None
            c = CompletionChunk(id=rid, created=created, model=model_name,
                                choices=[CompletionChoice(text=text, logprobs=lp, finish_reason=stream.finish_reason)],
                                usage=stream.usage(len(prompt_ids)) if is_last else None,
                                dspark=stream.spec_stats() if is_last else None)
            return f"data: {c.model_dump_json()}\n\n"

        def full() -> CompletionResponse:
            text = stream.delta()
            lp = stream.completion_logprobs(stream.logprobs) if wants_logprobs else None
            return CompletionResponse(
                id=rid, created=created, model=model_name,
                choices=[CompletionChoice(text=text, logprobs=lp, finish_reason=stream.finish_reason)],
                usage=stream.usage(len(prompt_ids)), dspark=stream.spec_stats())

        return await _respond(body.stream, first, gen, stream, chunk, full, record)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               response: Response) -> ChatCompletionResponse | StreamingResponse:
        prompt_ids, stream, gen, first, record = await begin(body, _encode_chat, request)
        response.headers[ARM_HEADER] = record.arm
        rid, created = new_id("chatcmpl"), int(time.time())
        is_first = [True]

        wants_logprobs = bool(body.logprobs)

        def chunk(text: str, is_last: bool) -> str:
            delta = ChatDelta(role="assistant" if is_first[0] else None, content=text)
            is_first[0] = False
            lp = stream.chat_logprobs(stream.new_logprobs()) if wants_logprobs else None
            choice = ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=stream.finish_reason)
            c = ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[choice],
                                    usage=stream.usage(len(prompt_ids)) if is_last else None,
                                    dspark=stream.spec_stats() if is_last else None)
            return f"data: {c.model_dump_json()}\n\n"

        def full() -> ChatCompletionResponse:
            message = ChatResponseMessage(content=stream.delta())
            lp = stream.chat_logprobs(stream.logprobs) if wants_logprobs else None
            return ChatCompletionResponse(
                id=rid, created=created, model=model_name,
                choices=[ChatChoice(message=message, logprobs=lp, finish_reason=stream.finish_reason)],
                usage=stream.usage(len(prompt_ids)), dspark=stream.spec_stats())

        return await _respond(body.stream, first, gen, stream, chunk, full, record)

    return app


async def _respond(is_stream: bool, first: RequestOutput, gen: AsyncIterator[RequestOutput], stream: TextStream,
                   chunk: Callable[[str, bool], str], full: Callable[[], Any], record: _RequestRecord) -> Any:
    """SSE of `chunk`s when streaming; otherwise run the request to the end and build `full()`."""
    if is_stream:
        return StreamingResponse(_sse(first, gen, stream, chunk, record), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, ARM_HEADER: record.arm})
    await _drain(first, gen, stream, record)
    return full()


@dataclass
class _RequestRecord:
    """One request's timing: the ingress metrics, and its line in the request log for `dspark ab report`."""

    arm: str
    request_id: str
    start_wall_s: float
    start_s: float
    log_file: Any
    metrics: Metrics | None = None
    num_prompt_tokens: int = 0
    first_s: float = 0.0
    last_s: float = 0.0
    model: LatencyModel | None = None  # the arm's latency model: it measures tokens per running request
    charge: Callable[[int], None] | None = None  # the key's tokens quota, charged at the end
    num_outputs: int = 0

    def on_output(self, out: RequestOutput) -> None:
        """An output reached the client: one inter-token-latency observation (vLLM: one per delivery)."""
        now = time.perf_counter()
        if self.model is not None and self.num_outputs and out.new_token_ids:
            self.model.tokens(len(out.new_token_ids))
        self.num_outputs += 1
        if self.metrics is not None and self.last_s and out.new_token_ids:
            self.metrics.observe("vllm:inter_token_latency_seconds", now - self.last_s)
        if out.new_token_ids:
            self.last_s = now

    def write(self, stream: TextStream, is_error: bool, is_aborted: bool = False) -> None:
        """`is_aborted`: the client went away mid-request (vLLM's finish reason `abort`); the engine's
        generator has been closed, which frees its KV slot and draft context."""
        now = time.perf_counter()
        n = len(stream.token_ids)
        if self.charge is not None:
            self.charge(self.num_prompt_tokens + n)
        m = self.metrics
        if m is not None:
            if is_aborted:
                m.inc("vllm:generation_tokens_total", n)
                m.inc("vllm:request_success_total", finished_reason="abort")
            elif is_error:
                m.inc("dspark_request_errors_total", status="stream")
            else:
                m.observe("vllm:time_to_first_token_seconds", self.first_s - self.start_s)
                m.observe("vllm:e2e_request_latency_seconds", now - self.start_s)
                if n > 1:
                    m.observe("vllm:request_time_per_output_token_seconds", (now - self.first_s) / (n - 1))
                m.inc("vllm:prompt_tokens_total", self.num_prompt_tokens)
                m.inc("vllm:generation_tokens_total", n)
                m.inc("vllm:request_success_total", finished_reason=stream.finish_reason or "stop")
        if self.log_file is None:
            return
        self.log_file.write(json.dumps({
            "arm": self.arm, "request_id": self.request_id, "start_s": self.start_wall_s,
            "ttft_s": self.first_s - self.start_s, "e2e_s": now - self.start_s,
            "num_output_tokens": n, "num_steps": stream.num_steps,
            "num_verified": stream.num_verified, "num_accepted": stream.num_accepted, "is_error": is_error,
            "is_aborted": is_aborted}) + "\n")


async def _drain(first: RequestOutput, gen: AsyncIterator[RequestOutput], stream: TextStream,
                 record: _RequestRecord) -> None:
    # aclose in finally: a client that hangs up cancels us here, and closing the engine's
    # generator is what aborts the request and frees its cache slot
    is_error, is_aborted = True, False
    try:
        async for out in _outputs(first, gen):
            stream.add(out)
            record.on_output(out)
        is_error = False
    except (asyncio.CancelledError, GeneratorExit):
        is_aborted = True
        raise
    finally:
        await gen.aclose()
        record.write(stream, is_error and not is_aborted, is_aborted)


async def _sse(first: RequestOutput, gen: AsyncIterator[RequestOutput], stream: TextStream,
               chunk: Callable[[str, bool], str], record: _RequestRecord) -> AsyncIterator[str]:
    is_error, is_aborted = True, False
    try:
        async for out in _outputs(first, gen):
            stream.add(out)
            record.on_output(out)
            text = stream.delta()
            if out.is_finished:
                yield chunk(text, True)
            elif text:
                yield chunk(text, False)
    except EngineDeadError as exc:  # headers are sent: report in-band, without internals
        log.warning("stream failed: %s", exc)
        info = ErrorInfo(message="the engine became unavailable; retry later", type="service_unavailable_error")
        yield f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client hung up mid-stream
        is_aborted = True
        raise
    else:
        is_error = False
    finally:
        await gen.aclose()
        record.write(stream, is_error and not is_aborted, is_aborted)
    yield "data: [DONE]\n\n"
