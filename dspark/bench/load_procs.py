"""A load generator spread over several processes: each owns a slice of the requests, its own event loop and
its own sockets; the records are gathered back in request order.

One Python process opens a burst of ~1,300 connections one after the other and reads their responses one
callback at a time: against a bare HAProxy answering 1,280 refusals (kernel receive time p99 under 1 ms)
one process read them at p99 25-60 ms, a wait the session-29 bench counted with the server's.
Records are now timed by the kernel's receive timestamps (`raw_http.post`; the read time is kept beside),
and the burst comes from `num_procs` processes (started once, before the phases, with no torch or Ray in
them), each sending `1/num_procs` of the requests, interleaved so that every process's share arrives
evenly, on an event loop of its own with the garbage collector off, at niceness +5 (`LOAD_NICE`: below
the cluster's request path, above its pools). They start at one instant, a `time.perf_counter()` deadline
(CLOCK_MONOTONIC, one clock for every process of the machine), so a burst is still one burst and the
records' `sent_at` compare across processes.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from dspark.bench.raw_http import post

START_DELAY_S = 0.25  # from the jobs being handed out to the common start (every process waits for it)
# the load processes' niceness over the bench's: on one machine with the cluster, below its request path
# (HAProxy at -10, the ingress at 0) so that sending a burst does not take the CPU the server answers it
# with (a client elsewhere would not), above its pools (+10) so that the burst is still sent at once
LOAD_NICE = 5


def default_num_procs() -> int:
    """One process per core, at least 2 and at most 8."""
    return max(2, min(8, os.cpu_count() or 2))


async def _run_slice(job: dict[str, Any]) -> list[tuple[int, dict]]:
    """This process's requests: request i sent at `start_at + spread_s * i / num` (all at `start_at` for a
    burst), on a connection of its own."""
    start_at, spread_s, num = job["start_at"], job["spread_s"], job["num"]

    async def one(i: int, body: dict) -> tuple[int, dict]:
        wait = start_at + spread_s * i / num - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        return i, await post(job["host"], job["port"], job["path"], body, job["headers"], job["timeout_s"])

    return list(await asyncio.gather(*(one(i, body) for i, body in job["items"])))


def _send(stream: IO[bytes], obj: object) -> None:
    """One object as a length-prefixed pickle, written with os.write to its last byte. (A buffered write to a
    full pipe came back short, with uvloop in the process, and the reader waited for the rest forever.)"""
    payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    data = memoryview(struct.pack("<Q", len(payload)) + payload)
    stream.flush()
    fd = stream.fileno()
    os.set_blocking(fd, True)
    while data:
        data = data[os.write(fd, data):]


def _recv(stream: IO[bytes]) -> Any:
    def exactly(n: int) -> bytes:
        parts, size = [], 0
        while size < n:
            part = stream.read(n - size)
            if not part:
                raise EOFError("a load process closed its pipe")
            parts.append(part)
            size += len(part)
        return b"".join(parts)

    (size,) = struct.unpack("<Q", exactly(8))
    return pickle.loads(exactly(size))


def serve_jobs() -> None:
    """A load process (`python -m dspark.bench.load_procs`): runs the jobs pickled to its stdin, pickles each
    job's records to its stdout, until it reads None."""
    gc.disable()  # no collection pauses mid-phase
    os.nice(LOAD_NICE)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    _send(out, "ready")
    while (job := _recv(inp)) is not None:
        loop = asyncio.new_event_loop()
        try:
            records = loop.run_until_complete(_run_slice(job))
        finally:
            loop.close()
        _send(out, records)
        gc.collect()  # between phases


class LoadProcesses:
    """`num_procs` load processes, started on entering the block and stopped on leaving it."""

    def __init__(self, num_procs: int | None = None) -> None:
        self.num_procs = max(1, num_procs or default_num_procs())
        self._procs: list[subprocess.Popen] = []
        self.started_at = 0.0  # perf_counter() when the last post_many's requests started

    def __enter__(self) -> LoadProcesses:
        # fresh interpreters (not forks of a process that may hold a Ray driver, nor multiprocessing's spawn,
        # which re-runs the caller's __main__), importing nothing but this module
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        try:
            for _ in range(self.num_procs):
                self._procs.append(subprocess.Popen([sys.executable, "-m", "dspark.bench.load_procs"], env=env,
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            for proc in self._procs:
                if _recv(proc.stdout) != "ready":  # type: ignore[arg-type]
                    raise RuntimeError("a load process did not start")
        except (EOFError, pickle.UnpicklingError, struct.error) as exc:
            self.__exit__()
            raise RuntimeError("a load process did not start") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            try:
                _send(proc.stdin, None)  # type: ignore[arg-type]
                proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def post_many(self, host: str, port: int, path: str, bodies: list[dict], headers: dict[str, str],
                  timeout_s: float, spread_s: float = 0.0) -> list[dict]:
        """POST every body (one connection each), all at one instant (`spread_s` 0) or arriving evenly over
        `spread_s`; the records in the order of `bodies`."""
        num = len(bodies)
        start_at = self.started_at = time.perf_counter() + START_DELAY_S
        for k, proc in enumerate(self._procs):
            items = [(i, bodies[i]) for i in range(k, num, self.num_procs)]
            _send(proc.stdin, {"host": host, "port": port, "path": path, "headers": headers,  # type: ignore[arg-type]
                               "timeout_s": timeout_s, "start_at": start_at, "spread_s": spread_s, "num": num,
                               "items": items})
        out: list[dict | None] = [None] * num
        for proc in self._procs:
            for i, rec in _recv(proc.stdout):  # type: ignore[arg-type]
                out[i] = rec
        return [r if r is not None else {"status": None, "latency_s": 0.0, "error": "lost"} for r in out]


if __name__ == "__main__":
    serve_jobs()
