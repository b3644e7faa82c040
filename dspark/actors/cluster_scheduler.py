"""The central scheduler's logic (no Ray): placement of new requests and per-worker verify capacity.

Workers report their load after steps (`WorkerLoad`); the scheduler answers each report with a
`CapacityDecision`: K, the number of draft tokens that worker verifies per step, chosen where the
expected throughput Θ(K) = E[accepted tokens] · SPS(tokens) of the REPORTED survival table peaks (the
asynchronous variant of DSpark §5.2: K comes from information at least one step old, the worker picks
its top-K candidates by current survival itself). `place` puts a new request on the verify worker
whose expected throughput grows most by taking it, among those with free KV slots. All state is soft:
a restarted scheduler rebuilds it from the next reports, and requests never live here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark.spec.schedulers import global_capacity, top_k_lengths
from dspark.spec.sps import SPSTable


@dataclass
class WorkerLoad:
    """One verify worker's report."""

    worker_id: str
    num_running: int
    num_waiting: int
    max_num_seqs: int
    step_index: int
    step_ms: float  # recent mean verify step time
    tokens_per_step: float  # recent mean tokens through the target per step
    survival: list[list[float]] = field(default_factory=list)  # last step's table, one row per request
    sps: dict[str, Any] | None = None  # the worker's SPS profile (SPSTable.to_dict())
    draft_worker: str | None = None


@dataclass
class CapacityDecision:
    worker_id: str
    capacity: int  # draft tokens to verify per step, over the worker's whole micro-batch
    based_on_step: int  # the worker step whose report it was computed from
    decision_ms: float


@dataclass
class Placement:
    request_id: str
    worker_id: str
    marginal_tokens_s: float
    at_s: float


class ClusterScheduler:
    """Holds the last report of every verify worker; see the module docstring."""

    def __init__(self, max_num_records: int = 512) -> None:
        self.loads: dict[str, WorkerLoad] = {}
        self.sps: dict[str, SPSTable] = {}
        self.decisions: dict[str, CapacityDecision] = {}
        self.pending: dict[str, int] = {}  # placements since the worker's last report
        self.placements: deque[Placement] = deque(maxlen=max_num_records)
        self.decision_ms: deque[float] = deque(maxlen=max_num_records)
        self.started_s = time.time()
        self.num_reports = 0

    # ---- reports and capacity ------------------------------------------------------------------
    def report(self, load: WorkerLoad) -> CapacityDecision:
        t0 = time.perf_counter()
        self.loads[load.worker_id] = load
        self.pending[load.worker_id] = 0
        if load.sps is not None:
            self.sps[load.worker_id] = SPSTable.from_dict(load.sps)
        sps = self.sps.get(load.worker_id)
        capacity = (global_capacity(load.survival, sps.for_requests(len(load.survival)))
                    if sps is not None and load.survival else 0)
        ms = (time.perf_counter() - t0) * 1e3
        decision = CapacityDecision(load.worker_id, capacity, load.step_index, ms)
        self.decisions[load.worker_id] = decision
        self.decision_ms.append(ms)
        self.num_reports += 1
        return decision

    def forget(self, worker_id: str) -> None:
        """A worker that left: its reports no longer count."""
        for table in (self.loads, self.sps, self.decisions, self.pending):
            table.pop(worker_id, None)

    # ---- placement -------------------------------------------------------------------------------
    def place(self, request_id: str, worker_ids: list[str]) -> str:
        """The verify worker (one of `worker_ids`) that gains the most expected tokens/s from this request."""
        if not worker_ids:
            raise ValueError("no verify workers to place on")
        t0 = time.perf_counter()
        best, best_gain = worker_ids[0], float("-inf")
        for wid in worker_ids:
            gain = self.marginal_gain(wid)
            if gain > best_gain:
                best, best_gain = wid, gain
        self.pending[best] = self.pending.get(best, 0) + 1
        self.placements.append(Placement(request_id, best, best_gain, time.time()))
        self.decision_ms.append((time.perf_counter() - t0) * 1e3)
        return best

    def num_assigned(self, worker_id: str) -> int:
        load = self.loads.get(worker_id)
        have = load.num_running + load.num_waiting if load else 0
        return have + self.pending.get(worker_id, 0)

    def marginal_gain(self, worker_id: str) -> float:
        """Expected tokens/s gained by one more request; a full worker ranks by how short its queue is."""
        load, sps = self.loads.get(worker_id), self.sps.get(worker_id)
        n = self.num_assigned(worker_id)
        if load is None or sps is None:  # not reported yet: spread by count
            return -float(n)
        if n >= load.max_num_seqs:
            return -1e9 - float(n - load.max_num_seqs)
        decision = self.decisions.get(worker_id)
        # expected tokens per request and step at the worker's current capacity
        tau = 1.0 + _mean_accepted(load.survival, decision.capacity if decision else 0)
        tokens_per_request = load.tokens_per_step / max(load.num_running, 1) if load.num_running else 1.0

        def throughput(num: int) -> float:  # a step of `num` requests, priced on its own row (`for_requests`)
            return num * tau * sps.for_requests(num).sps(max(1, round(num * tokens_per_request)))

        return throughput(n + 1) - throughput(n)

    # ---- observability ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        times = sorted(self.decision_ms)
        return {
            "num_reports": self.num_reports,
            "uptime_s": time.time() - self.started_s,
            "capacity": {w: asdict(d) for w, d in self.decisions.items()},
            "load": {w: {"num_running": ld.num_running, "num_waiting": ld.num_waiting, "step_ms": ld.step_ms,
                         "tokens_per_step": ld.tokens_per_step, "step_index": ld.step_index,
                         "pending": self.pending.get(w, 0), "draft_worker": ld.draft_worker}
                     for w, ld in self.loads.items()},
            "placements": [asdict(p) for p in list(self.placements)[-64:]],
            "decision_ms_mean": sum(times) / len(times) if times else 0.0,
            "decision_ms_p99": times[int(0.99 * (len(times) - 1))] if times else 0.0,
        }


def _mean_accepted(survival: list[list[float]], capacity: int) -> float:
    """Expected accepted draft tokens per request when the top-`capacity` candidates are verified."""
    if not survival:
        return 0.0
    lengths = top_k_lengths(survival, capacity)
    return sum(sum(row[:n]) for row, n in zip(survival, lengths)) / len(survival)
