"""The ingress's raw ASGI middleware: request id, bearer key, admin routes, admission and quotas, body size,
all before any routing or body parsing."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

from dspark.cluster.ingress.access import KeyRing, presented_digest
from dspark.cluster.ingress.admission import Mode
from dspark.cluster.ingress.admission_gate import MODE_HEADER, AdmissionGate
from dspark.cluster.ingress.errors import send_error
from dspark.cluster.ingress.quota_board import start_settling
from dspark.metrics.series import Metrics

ADMIN_PATHS = ("/v1/dspark/stats", "/metrics")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_BODY_BYTES = 1 << 20


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
            await send_error(send_with_id, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                              "authentication_error", {"WWW-Authenticate": "Bearer"})
            return
        scope["state"]["access"] = access
        if scope.get("path", "") in ADMIN_PATHS and access != "admin":
            await send_error(send_with_id, 403, "this route needs an admin API key", "permission_error")
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
                await send_error(send_with_id, refusal.status, refusal.message, refusal.type_, refusal.headers,
                                  refusal.code)
                return
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            await send_error(send_with_id, 400, "invalid Content-Length header")
            return
        if length > self.max_body_bytes:
            await send_error(send_with_id, 413, f"request body over {self.max_body_bytes} bytes")
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
                await send_error(send_with_id, 413, f"request body over {self.max_body_bytes} bytes")
                return
        body = b"".join(chunks)
        replayed = [False]

        async def replay() -> dict:
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send_with_id)
