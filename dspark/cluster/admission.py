"""Admission control at the ingress: a bounded number of requests in flight, the rest refused at once.

An engine batches `capacity` requests (max_num_seqs per verify worker) and queues the rest; past
`capacity + max_queued_requests` in flight, a new request is answered 429 with a `Retry-After` before
any work is done for it (no tokenisation, no placement), so overload costs the server microseconds and
the admitted requests keep a bounded latency. `Retry-After` is the time the current backlog needs to
drain at the recently measured completion rate (at least 1 s).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Admission:
    capacity: int
    max_queued_requests: int
    num_in_flight: int = 0
    num_rejected: int = 0
    _done_at: deque = field(default_factory=lambda: deque(maxlen=256))

    @property
    def limit(self) -> int:
        return self.capacity + self.max_queued_requests

    @property
    def is_full(self) -> bool:
        return self.num_in_flight >= self.limit

    def try_enter(self) -> bool:
        if self.is_full:
            self.num_rejected += 1
            return False
        self.num_in_flight += 1
        return True

    def leave(self) -> None:
        self.num_in_flight -= 1
        self._done_at.append(time.monotonic())

    def retry_after_s(self) -> int:
        """Seconds until the backlog beyond capacity has drained at the recent completion rate."""
        now = time.monotonic()
        recent = [t for t in self._done_at if now - t < 30.0]
        if len(recent) < 2:
            return 1
        rate = len(recent) / max(now - recent[0], 1e-3)  # completions per second
        backlog = max(1, self.num_in_flight - self.capacity)
        return max(1, math.ceil(backlog / rate))
