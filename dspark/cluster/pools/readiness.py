"""Whether an arm would answer a chat now: a cheap probe of its verify pool, its result cached briefly.

Serve routes to the ingress as soon as the ingress replica is up, which on a fresh machine is long before
any verify replica has loaded its target. Without this the server looked ready (`/v1/models` 200) while a
chat waited minutes or failed. So the ingress asks the verify pool itself, through the same handle a chat
takes: a replica answers `ready_probe` only once its engine steps. The answer is kept for `ttl_s`, so a
burst of requests costs one probe, and a probe that does not answer within `timeout_s` means "not yet" until the
pool has answered once; after that a slow probe keeps the last answer (busy, not gone; a dead replica fails fast).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2  # what a client warming-up 503 asks to wait


class ReadinessProbe:
    """`await is_ready()`: the last probe's answer if younger than `ttl_s`, else a fresh one (one at a time)."""

    def __init__(self, probe: Callable[[], Awaitable[object]], ttl_s: float = 1.0, timeout_s: float = 2.0) -> None:
        self.probe, self.ttl_s, self.timeout_s = probe, ttl_s, timeout_s
        self.is_ready_now = False
        self.checked_at = float("-inf")
        self.reason = "not probed yet"
        self._lock: asyncio.Lock | None = None

    async def is_ready(self) -> bool:
        if time.monotonic() - self.checked_at < self.ttl_s:
            return self.is_ready_now
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # concurrent callers share one probe
            if time.monotonic() - self.checked_at < self.ttl_s:
                return self.is_ready_now
            try:
                await asyncio.wait_for(self.probe(), self.timeout_s)
                is_ready, reason = True, "ready"
            except TimeoutError as exc:
                # a pool that answered before and is slow now is busy (on 2 cores, finishing a dead ingress
                # replica's cancelled streams took a probe past 2 s), not gone: a dead or missing replica fails the
                # probe at once. Refusing every chat on a slow probe turned one busy second into ~10 s of 503s
                # while the pool served (1 of 4 runs of the ingress-kill test, session 56).
                is_ready = self.is_ready_now
                reason = "probe slow; the pool answered before" if is_ready else f"{type(exc).__name__}: {exc}"[:200]
            except Exception as exc:  # noqa: BLE001 - any other failure (no replica yet, dead replica) is "not yet"
                is_ready, reason = False, f"{type(exc).__name__}: {exc}"[:200]
            if is_ready != self.is_ready_now:
                log.info("verify pool %s (%s)", "ready" if is_ready else "not ready", reason)
            self.is_ready_now, self.reason, self.checked_at = is_ready, reason, time.monotonic()
        return self.is_ready_now
