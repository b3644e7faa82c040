"""A bare HTTP/1.1 client for overload benches: one connection per request, timed inside the event loop's
callbacks.

Thousands of requests at once from one Python process: with asyncio streams (or httpx's pool) the time a
response waits for its coroutine to be resumed, behind every other connection's work, is counted as the
server's latency (a burst of 1,280 measured ~120 ms per refusal that HAProxy answered in ~1 ms). Here a
`Protocol` takes each timestamp in the callback where the bytes arrive, which the loop runs as soon as it
polls the socket, so what is measured is the server's time plus one poll.
"""

from __future__ import annotations

import asyncio
import json
import time


def request_bytes(host: str, port: int, path: str, payload: dict, headers: dict[str, str]) -> bytes:
    """A JSON POST as HTTP/1.1 bytes, on a connection of its own (`Connection: close`)."""
    body = json.dumps(payload).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{head}Connection: close\r\n\r\n").encode() + body


class _Exchange(asyncio.Protocol):
    def __init__(self, request: bytes, done: asyncio.Future) -> None:
        self.request, self.done = request, done
        self.chunks: list[bytes] = []
        self.sent_at = self.first_byte_at = self.first_event_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]
        self.sent_at = time.perf_counter()

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.chunks:
            self.first_byte_at = now
        self.chunks.append(data)
        if not self.first_event_at and b"data:" in data:  # a stream's first event: its first token
            self.first_event_at = now

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(time.perf_counter())


async def post(host: str, port: int, path: str, payload: dict, headers: dict[str, str], timeout_s: float) -> dict:
    """One POST; `latency_s` from the moment its bytes were written to the end of the response (the server
    closes the connection), `first_byte_s` to its first byte (for a refusal: when the client learns of it; the
    close is one more turn of this loop behind every other connection's callbacks), `status`, `retry_after`,
    `refused_by` (`front-door` for HAProxy's own refusals, `ingress` for other 429/503s), for errors the
    `reason` in the body, and for a stream its `ttft_s` (to its first event) and `tpot_s` (the rest over the
    tokens after the first)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    proto = _Exchange(request_bytes(host, port, path, payload, headers), done)
    t_conn = time.perf_counter()
    transport = None
    try:
        transport, _ = await asyncio.wait_for(loop.create_connection(lambda: proto, host, port), timeout_s)
        end = await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except (TimeoutError, OSError) as exc:
        if transport is not None:
            transport.abort()
        return {"status": None, "latency_s": time.perf_counter() - t_conn, "error": type(exc).__name__}
    data = b"".join(proto.chunks)
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        return {"status": None, "latency_s": end - proto.sent_at, "error": "bad status line"}
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if hdrs.get("transfer-encoding") == "chunked":
        body = unchunk(body)
    rec = {"status": status, "latency_s": end - proto.sent_at, "connect_s": proto.sent_at - t_conn,
           "first_byte_s": proto.first_byte_at - proto.sent_at,
           "retry_after": hdrs.get("retry-after"), "sent_at": proto.sent_at,
           "refused_by": hdrs.get("x-dspark-refused-by", "ingress") if status in (429, 503) else None}
    if status >= 400:
        try:
            err = json.loads(body)
            rec["reason"] = err["error"]["message"] if isinstance(err, dict) and "error" in err else None
        except (ValueError, KeyError, TypeError):
            rec["reason"] = body.decode("utf-8", "replace")[:200] or None  # Serve's proxy: plain text
    elif proto.first_event_at:  # a stream: TTFT, and TPOT from the usage in its last event
        rec["ttft_s"] = proto.first_event_at - proto.sent_at
        usage = _last_usage(body)
        if usage and usage.get("completion_tokens", 0) > 1:
            rec["num_tokens"] = usage["completion_tokens"]
            rec["tpot_s"] = (end - proto.first_event_at) / (usage["completion_tokens"] - 1)
    return rec


def _last_usage(body: bytes) -> dict | None:
    for line in reversed(body.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                return json.loads(line[6:]).get("usage")
            except ValueError:
                return None
    return None


def unchunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        size_end = data.find(b"\r\n", pos)
        if size_end < 0:
            return bytes(out)
        size = int(data[pos:size_end].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out)
        out += data[size_end + 2:size_end + 2 + size]
        pos = size_end + 2 + size + 2
