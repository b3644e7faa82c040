"""A bare HTTP/1.1 client for overload benches: one connection per request, timed by the kernel.

Thousands of requests at once: with asyncio streams (or httpx's pool) the time a response waits for its
coroutine to be resumed, behind every other connection's work, is counted as the server's latency (a burst
of 1,280 measured ~120 ms per refusal that HAProxy answered in ~1 ms); even a callback that takes the time
as soon as its loop polls the socket (what this module did before) counts the client's own queue (a bare
HAProxy's 1,280 refusals, received by the kernel within 1 ms, read by one process at p99 25-60 ms). Here
every read also asks the kernel when the bytes arrived on the socket (`SO_TIMESTAMPNS`), so the latency
measured is from the request's bytes being written to the response's bytes arriving, whatever the load
generator was doing meanwhile; the time the client's loop read them is kept beside it. Load from several
processes: `load_procs.py`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time


def request_bytes(host: str, port: int, path: str, payload: dict, headers: dict[str, str]) -> bytes:
    """A JSON POST as HTTP/1.1 bytes, on a connection of its own (`Connection: close`)."""
    body = json.dumps(payload).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{head}Connection: close\r\n\r\n").encode() + body


# SO_TIMESTAMPNS (Linux; not exported by Python's socket module): each recvmsg() on the socket also returns
# the time the kernel received the bytes (CLOCK_REALTIME), as a struct timespec (two 64-bit fields)
SO_TIMESTAMPNS = 35
_ANC_SPACE = socket.CMSG_SPACE(16)


class _Exchange:
    """One connection's reads, in a reader callback on the raw socket: each chunk with the time the kernel
    received it and the time this loop read it."""

    def __init__(self, sock: socket.socket, done: asyncio.Future, wall_offset: float) -> None:
        self.sock, self.done, self.wall_offset = sock, done, wall_offset
        self.chunks: list[bytes] = []
        self.arrived: list[float] = []  # kernel receive time of each chunk (perf_counter's clock)
        self.read_at: list[float] = []  # when this loop read it

    def on_readable(self) -> None:
        try:
            data, anc, _, _ = self.sock.recvmsg(1 << 18, _ANC_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(exc)
            return
        now = time.perf_counter()
        if not data:
            self._finish(None)
            return
        arrived = now
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= 16:
                sec, nsec = struct.unpack("qq", raw[:16])
                arrived = min(now, sec + nsec * 1e-9 - self.wall_offset)
        self.chunks.append(data)
        self.arrived.append(arrived)
        self.read_at.append(now)

    def _finish(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result((time.perf_counter(), exc))


async def post(host: str, port: int, path: str, payload: dict, headers: dict[str, str], timeout_s: float) -> dict:
    """One POST on a connection of its own. Times, from the moment its bytes were written (`sent_at`):
    `first_byte_s`, to the kernel receiving the first byte of the response on this socket (the server's
    time: for a refusal, when the client learns of it; not how long this process took to look), and
    `read_first_byte_s`, to this loop reading it; `latency_s`, to the end of the response (the server
    closes the connection); `connect_s`, from asking for the connection to it being up. Also `status`,
    `retry_after`, `refused_by` (`front-door` for HAProxy's own refusals, `ingress` for other 429/503s), for
    errors the `reason` in the body, and for a stream its `ttft_s` (to the kernel receiving its first event)
    and `tpot_s` (its first event to its last bytes, over the tokens after the first)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    request = request_bytes(host, port, path, payload, headers)
    t_conn = time.perf_counter()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    exchange: _Exchange | None = None
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:  # not Linux: the read time stands in for the kernel's
        pass
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout_s)
        connected = time.perf_counter()
        exchange = _Exchange(sock, done, time.time() - time.perf_counter())
        loop.add_reader(sock.fileno(), exchange.on_readable)
        await loop.sock_sendall(sock, request)
        sent_at = time.perf_counter()
        end, exc = await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except (TimeoutError, OSError) as exc_:
        return {"status": None, "latency_s": time.perf_counter() - t_conn, "error": type(exc_).__name__}
    finally:
        if exchange is not None:
            loop.remove_reader(sock.fileno())
        sock.close()
    ex = exchange
    if not ex.chunks:
        return {"status": None, "latency_s": end - sent_at, "error": type(exc).__name__ if exc else "no response"}
    data = b"".join(ex.chunks)
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        return {"status": None, "latency_s": end - sent_at, "error": "bad status line"}
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if hdrs.get("transfer-encoding") == "chunked":
        body = unchunk(body)
    rec = {"status": status, "latency_s": end - sent_at, "connect_s": connected - t_conn,
           "first_byte_s": max(0.0, ex.arrived[0] - sent_at), "read_first_byte_s": ex.read_at[0] - sent_at,
           "retry_after": hdrs.get("retry-after"), "sent_at": sent_at,
           "refused_by": hdrs.get("x-dspark-refused-by", "ingress") if status in (429, 503) else None}
    if status >= 400:
        try:
            err = json.loads(body)
            rec["reason"] = err["error"]["message"] if isinstance(err, dict) and "error" in err else None
        except (ValueError, KeyError, TypeError):
            rec["reason"] = body.decode("utf-8", "replace")[:200] or None  # Serve's proxy: plain text
        return rec
    first_event = next((t for chunk, t in zip(ex.chunks, ex.arrived) if b"data:" in chunk), None)
    if first_event is not None:  # a stream: TTFT, and TPOT from the usage in its last event
        rec["ttft_s"] = first_event - sent_at
        usage = _last_usage(body)
        if usage and usage.get("completion_tokens", 0) > 1:
            rec["num_tokens"] = usage["completion_tokens"]
            rec["tpot_s"] = (ex.arrived[-1] - first_event) / (usage["completion_tokens"] - 1)
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
