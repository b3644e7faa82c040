"""Runs an Engine's step loop on a background thread and streams outputs to asyncio callers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from dspark.kernels import omp_teams
from dspark.verify_service.engine import Engine
from dspark.verify_service.engine_stats import engine_stats
from dspark.verify_service.heap import release_free_memory
from dspark.verify_service.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    """Thread-safe front of an Engine: `generate()` yields RequestOutputs as the engine steps.

    Requests join and leave between steps; a caller that stops iterating (client gone) aborts its
    request, which frees its cache slot at the next step.
    """

    def __init__(self, engine: Engine, on_step: Callable[[], None] | None = None,
                 on_idle: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after every step (cluster load reports)
        self.on_idle = on_idle  # called on the engine thread at most every 0.5 s while idle (metrics)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._stepped_since_trim = False
        # engine thread only: outputs the stream interval holds back (merged), and when each stream last sent
        self._held: dict[str, RequestOutput] = {}
        self._sent_at: dict[str, float] = {}
        self.num_trims = 0  # idle spells after work whose freed heap went back to the OS
        omp_teams.release()  # the loading thread's team would halve the loop thread's speed (see there)
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def stats(self) -> dict[str, Any]:
        """`/v1/dspark/stats` of an inline deployment: its one engine's step timeline and draft gate, read as a
        pool engine's workers are (`engine_stats`)."""
        return {"mode": "inline", "workers": {"inline": {"worker_id": "inline", "mode": "inline",
                                                         **engine_stats(self.engine), "at_s": time.time()}}}

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per step that gave this request tokens, the last with is_finished."""
        self.engine.validate(prompt_ids, params)  # ValueError -> the caller's 400
        rid = request_id or f"req-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:  # checked under the lock that _fail_all holds: no request slips past a death
            if self._error is not None:
                raise EngineDeadError(f"engine loop died: {self._error!r}")
            self._queues[rid] = (asyncio.get_running_loop(), queue)
            self._pending.append((rid, prompt_ids, params))
        self._wake.set()
        finished = False
        merge = self.engine.config.merge_stream_outputs
        try:
            while True:
                item = await queue.get()
                # the steps this caller has not taken yet go out as one output (a busy event loop, a slow
                # consumer): one message downstream however many steps it fell behind
                while (merge and not isinstance(item, BaseException) and not item.is_finished
                       and not queue.empty()):
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        queue.put_nowait(nxt)  # after the tokens it follows
                        break
                    item = merge_outputs(item, nxt)
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine step failed: {item!r}") from item
                yield item
                if item.is_finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._queues.pop(rid, None)
                if not finished:
                    self._aborts.append(rid)
            self._wake.set()

    def wake(self) -> None:
        """Run the idle hooks now rather than at the next 0.5 s tick."""
        self._wake.set()

    @property
    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        eng = self.engine
        while not self._stopped:
            with self._lock:
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
            for rid, prompt_ids, params in pending:
                try:
                    eng.add_request(prompt_ids, params, request_id=rid)
                except Exception as exc:  # noqa: BLE001 - that request fails, the loop goes on
                    self._fail_one(rid, exc)
            for rid in aborts:
                eng.abort(rid)
                self._held.pop(rid, None)
                self._sent_at.pop(rid, None)
            if not eng.has_unfinished():
                self._idle(eng)
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = eng.step()
            except BaseException as exc:  # noqa: BLE001 - fail the waiting requests, never hang them
                log.exception("engine step failed")
                self._fail_all(exc)
                return
            self._stepped_since_trim = True
            if self.on_step is not None:
                try:
                    self.on_step()
                except Exception:  # noqa: BLE001 - a failed report must not stop serving
                    log.exception("on_step hook failed")
            self._send(self._due(outputs, time.monotonic()))

    def _due(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        """What goes out now, with a stream interval: a request's first and finishing outputs at once, the
        others merged and sent at most once an interval. Each message downstream (a Ray stream item to the
        ingress, an SSE chunk) costs CPU the engine shares at high concurrency; tokens are only held, never
        changed (merge_outputs keeps their order and log-probs)."""
        interval = self.engine.config.stream_interval_ms / 1e3
        if interval <= 0 and not self._held:
            return outputs
        due: list[RequestOutput] = []
        for out in outputs:
            rid = out.request_id
            held = self._held.pop(rid, None)
            if held is not None:
                out = merge_outputs(held, out)
            sent = self._sent_at.get(rid)
            if out.is_finished:
                self._sent_at.pop(rid, None)
            elif sent is None or now - sent >= interval:
                self._sent_at[rid] = now
            else:
                self._held[rid] = out
                continue
            due.append(out)
        for rid in [r for r, out in self._held.items() if now - self._sent_at[r] >= interval]:
            due.append(self._held.pop(rid))  # a request that gained nothing this step (preempted) still flushes
            self._sent_at[rid] = now
        return due

    def _send(self, outputs: list[RequestOutput]) -> None:
        with self._lock:  # one wake-up per event loop per step, not one per request
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
            for out in outputs:
                target = self._queues.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
            for loop, items in by_loop.items():
                loop.call_soon_threadsafe(_deliver, items)

    def _idle(self, eng: Engine) -> None:
        """An idle engine still keeps its links alive (a paired draft worker's receive would time out), and
        gives the heap the last burst left behind back to the OS, once per idle spell."""
        if self._stepped_since_trim:
            self._stepped_since_trim = False
            release_free_memory()
            self.num_trims += 1
        if self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:  # noqa: BLE001 - metrics must not stop serving
                log.exception("on_idle hook failed")
        keepalive = getattr(eng, "keepalive", None)
        if keepalive is None:
            return
        try:
            keepalive()
        except Exception as exc:  # noqa: BLE001 - a dead link fails what comes next, loudly
            log.exception("keepalive failed")
            self._fail_all(exc)
            self._stopped = True

    def _fail_one(self, rid: str, exc: BaseException) -> None:
        with self._lock:
            target = self._queues.get(rid)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, exc)

    def _fail_all(self, exc: BaseException) -> None:
        held, self._held = list(self._held.values()), {}
        self._send(held)  # the tokens held back go out before the error (resume.py continues after them)
        with self._lock:
            self._error = exc
            for loop, queue in self._queues.values():
                loop.call_soon_threadsafe(queue.put_nowait, exc)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: `then`'s state, both steps' tokens (and log-probs)."""
    logprobs = None
    if first.new_logprobs is not None or then.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (then.new_logprobs or [])
    return dataclasses.replace(then, new_token_ids=first.new_token_ids + then.new_token_ids, new_logprobs=logprobs)
