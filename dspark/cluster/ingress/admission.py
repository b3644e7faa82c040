"""Admission control at the ingress: admit a request when the latency it would get is within the SLA.

Per arm. `sla` mode (the default): a request is admitted when its predicted time to first token is within
the SLA's TTFT and, with it, the running batch's predicted time per output token stays within the SLA's
TPOT (both times `headroom`), as `latency_model.LatencyModel` predicts them from rates measured at this
ingress. Otherwise it is refused at once with 429 and `Retry-After` = the predicted wait until a request
would be admitted (the time for enough in-flight requests to finish, at the measured completion rate).
Whatever the prediction, the static limit `capacity + max_queued_requests` is a hard bound (memory).
`static` mode: only that bound (what Ray Serve's `max_queued_requests` offers), kept for comparison
(`dspark bench overload` runs both) and for deployments that want it.

The limit it computes is published: every response of the generate routes carries it for the front door
(front_door_rules.py), which then refuses a burst itself. It also measures the pressure on the arm, demand
over what the current replicas serve within the SLA, which the autoscaler reads (scale before shedding).
Refusals cost no work: nothing is tokenised or placed for them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from dspark.cluster.ingress.latency_model import LatencyModel

Mode = Literal["sla", "static"]
PRESSURE_WINDOW_S = 10.0
MAX_PRESSURE = 10.0


@dataclass
class SLATarget:
    ttft_s: float
    tpot_s: float
    headroom: float = 0.85


@dataclass
class Admission:
    """One arm's admission. `capacity`: requests its engines batch (max_num_seqs per verify replica);
    `sla`: None for static admission only."""

    capacity: int
    max_queued_requests: int
    sla: SLATarget | None = None
    max_batch: int | None = None  # requests one verify replica batches (max_num_seqs); None: capacity
    num_ingress_replicas: int = 1  # ingress replicas sharing the arm's verify pool (each sees its share)
    cold_start_batch: int | None = None  # per verify replica before the first measurement; None: one batch
    stream_interval_s: float = 0.0  # streams deliver at most this often: the token-rate windows span several
    num_in_flight: int = 0
    num_admitted: int = 0
    num_rejected: int = 0
    num_shed: int = 0  # refused by the SLA while under the static limit
    model: LatencyModel = field(init=False)
    _done_at: deque = field(default_factory=lambda: deque(maxlen=256))
    _arrivals: deque = field(default_factory=lambda: deque(maxlen=8192))  # (time, was admitted)
    _limit_cache: tuple[int, float, int] = (-1, -1.0, 0)  # (model version, replicas, limit)
    limit_reason: str = "bound"  # what stopped the SLA limit where it is: ttft | tpot | unmeasured | bound

    def __post_init__(self) -> None:
        self.model = LatencyModel(max_batch=max(1, self.max_batch or self.capacity),
                                  num_replicas=1 / max(1, self.num_ingress_replicas),
                                  window_s=max(LatencyModel.window_s, 4 * self.stream_interval_s))

    @property
    def mode(self) -> Mode:
        return "static" if self.sla is None else "sla"

    @property
    def hard_limit(self) -> int:
        return self.capacity + self.max_queued_requests

    @property
    def limit(self) -> int:
        """The static limit (kept under this name for callers that size queues by it)."""
        return self.hard_limit

    @property
    def is_full(self) -> bool:
        """At the hard bound: whatever the mode, a request would be refused."""
        return self.num_in_flight >= self.hard_limit

    def set_replicas(self, num_replicas: int) -> None:
        """The arm's verify pool now has `num_replicas` (it scaled): its capacity per replica stays. Each of
        N ingress replicas (balanced by the front door) holds 1/N of the pool's requests, so it predicts
        with R / N verify replicas for its own."""
        self.model.num_replicas = max(1, num_replicas) / max(1, self.num_ingress_replicas)

    def sla_limit(self) -> int:
        """Most requests in flight whose predicted latency is within the SLA (at least 1, at most the hard
        bound). An SLA this hardware cannot meet even for one request still admits one at a time. What
        stopped it at that number is `limit_reason`."""
        if self.sla is None:
            return self.hard_limit
        version, replicas, cached = self._limit_cache
        if version == self.model.version and replicas == self.model.num_replicas:
            return cached
        m, s = self.model, self.sla
        limit, reason = 0, "bound"
        for n in range(1, self.hard_limit + 1):
            tpot, ttft = m.predicted_tpot_s(n), m.predicted_ttft_s(n)
            if tpot is None or ttft is None:  # nothing measured yet: one batch per replica, no queue
                if m.per_replica(n) > (self.cold_start_batch or m.max_batch):
                    reason = "unmeasured"
                    break
            elif tpot > s.headroom * s.tpot_s:
                reason = "tpot"
                break
            elif ttft > s.headroom * s.ttft_s:
                reason = "ttft"
                break
            limit = n
        limit = max(1, limit)
        self._limit_cache = (m.version, m.num_replicas, limit)
        self.limit_reason = reason
        return limit

    @property
    def num_verify_replicas(self) -> int:
        """The arm's verify replicas this admission predicts with (all of them, not this ingress's share)."""
        return max(1, round(self.model.num_replicas * max(1, self.num_ingress_replicas)))

    def refusal_reason(self, mode: Mode | None = None) -> str:
        """Why a request refused now is refused: `full` (the static bound) or, under the SLA, the bound that
        set its limit: `ttft` / `tpot` (one more request's predicted latency), `unmeasured` (before any
        measurement, one batch per verify replica)."""
        if self.num_in_flight >= self.hard_limit or (mode or self.mode) == "static":
            return "full"
        self.sla_limit()
        return self.limit_reason

    def current_limit(self, mode: Mode | None = None) -> int:
        return self.hard_limit if (mode or self.mode) == "static" else self.sla_limit()

    def try_enter(self, mode: Mode | None = None) -> bool:
        """Admit (True) or refuse (False) one request now; `mode` overrides this arm's for one request."""
        now = time.monotonic()
        if self.num_in_flight >= self.current_limit(mode):
            self.num_rejected += 1
            if self.num_in_flight < self.hard_limit:
                self.num_shed += 1
            self._arrivals.append((now, False))
            return False
        self.num_in_flight += 1
        self.num_admitted += 1
        self._arrivals.append((now, True))
        return True

    def leave(self) -> None:
        self.num_in_flight -= 1
        self._done_at.append(time.monotonic())

    def retry_after_s(self, mode: Mode | None = None) -> int:
        """Whole seconds until a request would be admitted: the in-flight requests past the limit (and one
        more) finishing at the measured completion rate; at least 1."""
        if (mode or self.mode) == "static":
            return self._static_retry_after_s()
        to_leave = self.num_in_flight + 1 - self.sla_limit()
        if to_leave <= 0:
            return 1
        return max(1, math.ceil(self.model.wait_s(to_leave)))

    def _static_retry_after_s(self) -> int:
        now = time.monotonic()
        recent = [t for t in self._done_at if now - t < 30.0]
        if len(recent) < 2:
            return 1
        rate = len(recent) / max(now - recent[0], 1e-3)  # completions per second
        backlog = max(1, self.num_in_flight - self.capacity)
        return max(1, math.ceil(backlog / rate))

    def pressure(self) -> float:
        """Demand on the arm in units of what its current replicas serve within the SLA: in flight over the
        SLA limit while nothing is refused; (admitted + refused) / admitted over the last 10 s while it
        sheds. Over 1: the arm needs more replicas (the autoscaler reads this, autoscale/serve_policy.py)."""
        now = time.monotonic()
        recent = [ok for t, ok in self._arrivals if now - t < PRESSURE_WINDOW_S]
        num_ok = sum(recent)
        num_refused = len(recent) - num_ok
        in_use = self.num_in_flight / max(1, self.sla_limit())
        if num_refused == 0:
            return in_use
        return min(MAX_PRESSURE, max(in_use, len(recent) / max(num_ok, 1)))
