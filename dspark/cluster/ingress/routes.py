"""The OpenAI-compatible HTTP front: /v1/models, /v1/completions, /v1/chat/completions, /health.

The app talks to any engine with an AsyncEngine-shaped `generate()` and a `tokenizer`, fetched per
request through `get_engine`, so a distributed engine can replace the in-process one unchanged.
Client mistakes are always 4xx with an OpenAI-style `{"error": {...}}` body; a dead engine is a 503
with `Retry-After`, overload a 429 with `Retry-After` (see `admission.py`), and so is a pool still warming up:
`/v1/models` and `/health` answer 200 only when a chat would be answered (`readiness.py`). Every request has an id
(`x-request-id`); what went wrong inside is logged under it, and error bodies carry only the id, never
a traceback, an address or a path. Bearer keys guard every route (`access.py`); the operator routes
(`/v1/dspark/stats`) need an admin key.

This module holds the routes; around them: guard.py (the middleware), errors.py, responses.py (engine output
to SSE or one body), text_stream.py (tokens to text, stop strings), request_log.py (metrics and the A/B log).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from dspark.cluster.ingress.ab import ARM_HEADER, OVERRIDE_HEADER, SESSION_HEADER, Arm, chosen_arm
from dspark.cluster.ingress.access import KeyRing
from dspark.cluster.ingress.admission import Admission
from dspark.cluster.ingress.admission_gate import AdmissionGate
from dspark.cluster.ingress.api_models import (
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
    ModelCard,
    ModelList,
    new_id,
)
from dspark.cluster.ingress.engine import GenerateEngine
from dspark.cluster.ingress.errors import ApiError, install_error_handlers, refused, request_id_of, warming_up
from dspark.cluster.ingress.guard import DEFAULT_MAX_BODY_BYTES, GuardMiddleware
from dspark.cluster.ingress.quotas import QuotaBook
from dspark.cluster.ingress.request_log import RequestRecord
from dspark.cluster.ingress.responses import Released, respond, start_request
from dspark.cluster.ingress.text_stream import TextStream
from dspark.metrics.series import Metrics
from dspark.verify_service.request import RequestOutput


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
    `metrics_text()`: the Prometheus text `GET /metrics` serves (see metrics/export.py). `admission`: per arm
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
                              request_id_of(request), request.headers.get(OVERRIDE_HEADER),
                              state.get("access") == "admin")
        except ValueError as exc:
            raise ApiError(400, str(exc), param=OVERRIDE_HEADER) from exc

    async def begin(body: Any, encode: Any, request: Request) -> tuple[list[int], TextStream, Any, RequestOutput,
                                                                         RequestRecord]:
        """Admit, pick the arm, validate the model name, encode, submit, and wait for the first output
        (errors → 4xx). The admission ticket is held by the returned generator: closing it (end, error,
        client gone) gives it back."""
        check_model(body.model)
        arm = pick_arm(body, request)
        engine = arm_engines[arm]() if arm_engines else get_engine()
        if not await _is_ready(engine):  # warming up: say when to come back, queue nothing
            raise warming_up()
        state = request.scope.get("state", {})
        adm = admissions.get(arm) if admissions else None  # per arm: admitted by predicted latency
        if gate is not None and adm is not None:
            refusal = gate.enter(arm, state.get("admission_mode"), getattr(engine, "num_verify_replicas", None))
            if refusal is not None:
                raise refused(refusal)
        num_in_flight = adm.num_in_flight if adm is not None else 0
        replicas_at_start = adm.model.num_replicas if adm is not None else None
        record = RequestRecord(arm, request_id_of(request), time.time(), time.perf_counter(), log_file,
                                metrics.get(arm) if metrics else None)
        digest = state.get("key_digest")
        if quotas is not None and digest:
            record.charge = lambda n: quotas.charge_tokens(digest, n)
        try:
            prompt_ids = encode(engine.tokenizer, body)
            stream = TextStream(engine.tokenizer, body.stop_list())
            params = body.sampling_params()
            params.tenant = digest or ""  # the suffix proposer's served text stays within the key
            gen, first = await start_request(engine, prompt_ids, params)
        except BaseException:
            if adm is not None:
                adm.leave()
            raise
        record.first_s = record.last_s = time.perf_counter()
        record.num_prompt_tokens = len(prompt_ids)
        if adm is None:
            return prompt_ids, stream, Released(gen, None), first, record
        adm.model.first_token(record.first_s - record.start_s, num_in_flight, replicas_at_start)  # itself included
        record.model = adm.model

        def closed() -> None:
            adm.leave()
            adm.model.finished(record.last_s - record.first_s, was_decoding=True)

        return prompt_ids, stream, Released(gen, closed), first, record

    async def check_ready() -> None:
        """503 unless every arm would answer a chat now (the engine loop runs, the pool answered its probe)."""
        engines = [f() for f in arm_engines.values()] if arm_engines else [get_engine()]
        if not all(e.is_alive for e in engines):
            raise ApiError(503, "engine loop is not running", type_="service_unavailable_error", code="engine_dead",
                           headers={"Retry-After": "5"})
        if not all(await asyncio.gather(*(_is_ready(e) for e in engines))):
            raise warming_up()

    @app.get("/health")
    async def health() -> dict[str, str]:
        await check_ready()
        return {"status": "ok"}

    @app.get("/v1/dspark/stats")
    def dspark_stats() -> dict[str, Any]:  # sync: gathering worker stats blocks, so FastAPI threads it
        stats = getattr(get_engine(), "stats", None)
        if not callable(stats):
            raise ApiError(404, "this deployment's engine keeps no stats", code="no_stats")
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

        return await respond(body.stream, first, gen, stream, chunk, full, record)

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

        return await respond(body.stream, first, gen, stream, chunk, full, record)

    return app


