"""What the ingress answers when something goes wrong: an OpenAI-style `{"error": {...}}` body, 4xx for
client mistakes (never 422), 503 with `Retry-After` for a dead or warming engine, 500 with the request id
only (the details stay in this module's log)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.cluster.ingress.admission_gate import Refusal
from dspark.cluster.ingress.api_models import ErrorInfo, ErrorResponse
from dspark.cluster.pools.readiness import RETRY_AFTER_S
from dspark.verify_service.async_engine import EngineDeadError

log = logging.getLogger(__name__)


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


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or "unknown"


async def send_error(send: Callable, status: int, message: str, type_: str = "invalid_request_error",
                      headers: dict[str, str] | None = None, code: str | None = None) -> None:
    body = json.dumps(ErrorResponse(error=ErrorInfo(message=message, type=type_, code=code)).model_dump()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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
        message, param = validation_message(exc)
        return error_response(400, ErrorInfo(message=message, param=param))

    @app.exception_handler(ApiError)
    async def _on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.info, exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        rid = request_id_of(request)
        log.error("request %s: engine unavailable: %s", rid, exc)
        return error_response(503, ErrorInfo(message=f"the engine is unavailable; retry later (request id {rid})",
                                             type="service_unavailable_error"), {"Retry-After": "5"})

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, ErrorInfo(message=str(exc.detail)))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id_of(request)
        log.error("request %s failed", rid, exc_info=exc)  # the details stay in the server's log
        return error_response(500, ErrorInfo(message=f"internal error (request id {rid})", type="server_error"))


def refused(refusal: Refusal) -> ApiError:
    return ApiError(refusal.status, refusal.message, type_=refusal.type_, code=refusal.code, headers=refusal.headers)


def warming_up() -> ApiError:
    return ApiError(503, "the model is warming up (loading on its workers); retry shortly",
                    type_="service_unavailable_error", code="warming_up",
                    headers={"Retry-After": str(RETRY_AFTER_S)})
