"""What latency a request would get from one arm, predicted from rates measured at the ingress.

Measured here, per arm, from the requests this ingress replica sends (no call to any other process):
- TPOT at per-replica batch size b: tokens delivered per second per decoding request over short windows
  (`window_s`), binned by the window's mean decoding requests per verify replica; TPOT(b) = 1 / that rate.
- TTFT at per-replica load m (requests in flight, this one included, per verify replica, when it was sent).
- completions per second, and how long a request runs (first token to last), for the wait in a queue.
Each bin is an exponentially weighted mean. Between two measured bins the prediction interpolates; past the
highest measured bin it extrapolates with no further batching gain: the arm's token rate never falls as
the batch grows, so TPOT(b) <= TPOT(b_hi) * b / b_hi, an upper bound. Predictions are therefore
conservative where nothing was measured, and admission grows the batch step by step into what it has
measured (`explore`), which is how it finds the largest batch the SLA allows on hardware it has never seen.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Bins:
    """Exponentially weighted means of a latency by integer load, monotone when read.

    A reading is counted at most `max_jump` times the bin's mean: one request that waited for reasons the
    load does not say (placed behind a full batch while another replica had room, the first request of a
    replica still warming up) must not move a bin by more than alpha x (max_jump - 1) of itself. With the raw
    reading one such TTFT of 2 s in a bin of 50 ms sent admission's limit from 4 back to 2 with two replicas
    up (session 35's flap); a load that really is slower still gets there, by up to 1.6x per reading."""

    alpha: float = 0.3
    max_jump: float = 3.0
    means: dict[int, float] = field(default_factory=dict)

    def add(self, load: int, value_s: float) -> None:
        old = self.means.get(load)
        if old is None:
            self.means[load] = value_s
            return
        if old > 0:
            value_s = min(value_s, old * self.max_jump)
        self.means[load] = old + self.alpha * (value_s - old)

    def at(self, load: int) -> float | None:
        """The latency at `load`: None with no measurement at all; never below a lower load's."""
        if not self.means:
            return None
        loads = sorted(self.means)
        # read monotone: latency does not fall with load (a noisy lower reading above a higher one is noise)
        running, mono = 0.0, []
        for x in loads:
            running = max(running, self.means[x])
            mono.append(running)
        i = bisect.bisect_left(loads, load)
        if i < len(loads) and loads[i] == load:
            return mono[i]
        if i == 0:
            return mono[0]  # below every measured load: at most the lowest one's
        if i == len(loads):
            return mono[-1] * load / loads[-1]  # past the highest: no further batching gain (upper bound)
        lo, hi = loads[i - 1], loads[i]
        return mono[i - 1] + (mono[i] - mono[i - 1]) * (load - lo) / (hi - lo)

    @property
    def max_load(self) -> int:
        return max(self.means, default=0)


@dataclass
class LatencyModel:
    """One arm's measured latency by load. `max_batch`: requests one verify replica batches (max_num_seqs)."""

    max_batch: int
    num_replicas: float = 1.0  # verify replicas this ingress's requests have (a share when ingresses are many)
    window_s: float = 0.5
    tpot: _Bins = field(default_factory=_Bins)
    ttft: _Bins = field(default_factory=_Bins)
    num_decoding: int = 0
    version: int = 0  # bumped on every new measurement (callers cache what they derive from it)
    _run_s: float = 0.0  # EWMA of first token -> last token of finished requests
    _done_at: deque = field(default_factory=lambda: deque(maxlen=512))
    _window_start: float = field(default_factory=time.monotonic)
    _window_tokens: int = 0
    _window_area: float = 0.0  # integral of decoding requests over the window (request-seconds)
    _last_change: float = field(default_factory=time.monotonic)

    # ---- observations -----------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        self._window_area += self.num_decoding * (now - self._last_change)
        self._last_change = now
        if now - self._window_start < self.window_s:
            return
        if self._window_tokens >= 4 and self._window_area > 0:
            mean_decoding = self._window_area / (now - self._window_start)
            per_replica = max(1, round(mean_decoding / max(self.num_replicas, 1)))
            self.tpot.add(per_replica, self._window_area / self._window_tokens)  # request-seconds per token
            self.version += 1
        self._window_start, self._window_tokens, self._window_area = now, 0, 0.0

    def first_token(self, ttft_s: float, num_in_flight_at_start: int,
                    num_replicas_at_start: float | None = None) -> None:
        """A request got its first output `ttft_s` after it was sent, with this many in flight (itself too)
        over `num_replicas_at_start` verify replicas (default: the current count; a replica counted since the
        request was sent did not serve the load it was sent into)."""
        now = time.monotonic()
        self._advance(now)
        self.num_decoding += 1
        self.ttft.add(self.per_replica(num_in_flight_at_start, num_replicas_at_start), ttft_s)
        self.version += 1

    def tokens(self, num: int) -> None:
        """A decoding request delivered `num` more tokens (after its first output)."""
        self._advance(time.monotonic())
        self._window_tokens += num

    def finished(self, run_s: float | None, was_decoding: bool) -> None:
        """A request ended; `run_s`: its first token to its last (None when it never got one)."""
        now = time.monotonic()
        self._advance(now)
        if was_decoding:
            self.num_decoding -= 1
        self._done_at.append(now)
        if run_s is not None:
            self._run_s = run_s if not self._run_s else self._run_s + 0.2 * (run_s - self._run_s)

    # ---- predictions ------------------------------------------------------------------------------
    def per_replica(self, num_in_flight: int, num_replicas: float | None = None) -> int:
        replicas = self.num_replicas if num_replicas is None else num_replicas
        return max(1, math.ceil(num_in_flight / max(replicas, 1)))

    def completion_rate(self, now: float | None = None) -> float | None:
        """Requests finished per second over the last 30 s; None without two of them."""
        now = time.monotonic() if now is None else now
        recent = [t for t in self._done_at if now - t < 30.0]
        if len(recent) < 2:
            return None
        return len(recent) / max(now - recent[0], 1e-3)

    def predicted_tpot_s(self, num_in_flight: int) -> float | None:
        """TPOT of the running batch with `num_in_flight` requests in the arm (the engines batch up to
        max_batch per replica; the rest wait)."""
        return self.tpot.at(min(self.per_replica(num_in_flight), self.max_batch))

    def predicted_ttft_s(self, num_in_flight: int) -> float | None:
        """TTFT of a request that makes it `num_in_flight`: its start at that load, plus, past the batches,
        the wait for the requests ahead of it to leave (at max_batch per replica per run time)."""
        m = self.per_replica(num_in_flight)
        start = self.ttft.at(min(m, self.max_batch))
        if start is None:
            return None
        queued = m - self.max_batch
        if queued <= 0:
            return start
        if not self._run_s:
            return math.inf  # queueing with no measured run time: not predictable, so not admissible
        return start + queued * self._run_s / self.max_batch

    def measured_batch(self) -> int:
        """The largest per-replica batch with a TPOT measurement (0: none yet)."""
        return self.tpot.max_load

    def wait_s(self, num_to_leave: int) -> float:
        """Predicted time until `num_to_leave` of the requests in flight have finished."""
        rate = self.completion_rate()
        if rate is None:
            rate = self.max_batch * self.num_replicas / self._run_s if self._run_s else 0.0
        return num_to_leave / rate if rate > 0 else 1.0
