"""The central SchedulerActor (one named Ray actor, restarted by Ray if it dies) and its client.

The actor wraps `ClusterScheduler`. Workers talk to it through `SchedulerClient`, which never blocks
the step loop: a report is sent, and its answer (the capacity decision) is picked up on a later step
if it is ready. If the actor is gone or restarting, the client says so and the worker runs local
Algorithm 1 until answers come back; state is rebuilt from the next reports, so a restart loses nothing.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

from dspark.actors.cluster_scheduler import CapacityDecision, ClusterScheduler, WorkerLoad
from dspark.actors.registry import Registry
from dspark.metrics.series import Metrics

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class SchedulerActor:
    def __init__(self, labels: dict[str, str] | None = None) -> None:
        self.scheduler = ClusterScheduler()
        self.registry = Registry()
        lab = labels or {}
        self.metrics = Metrics(lab.get("model_name", ""), lab.get("arm", "default"), "scheduler",
                               lab.get("replica", "scheduler"))

    def report(self, load: WorkerLoad) -> CapacityDecision:
        t0 = time.perf_counter()
        decision = self.scheduler.report(load)
        self.metrics.observe("dspark_scheduler_decision_seconds", time.perf_counter() - t0, decision="capacity")
        return decision

    def place(self, request_id: str, worker_ids: list[str]) -> str:
        t0 = time.perf_counter()
        worker = self.scheduler.place(request_id, worker_ids)
        self.metrics.observe("dspark_scheduler_decision_seconds", time.perf_counter() - t0, decision="place")
        return worker

    def snapshot(self) -> dict[str, Any]:
        return {**self.scheduler.snapshot(), "replicas": self.registry.snapshot()}

    # ---- the Serve pools' membership (see registry.py) ---------------------------------------------
    def heartbeat(self, pool: str, replica_id: str, info: dict[str, Any] | None = None,
                  is_draining: bool = False) -> None:
        self.registry.heartbeat(pool, replica_id, info, is_draining)

    def leave(self, replica_id: str) -> None:
        self.registry.leave(replica_id)
        self.scheduler.forget(replica_id)

    def live(self, pool: str) -> list[str]:
        return self.registry.live(pool)

    def assign_draft(self, verify_id: str, exclude: list[str] | None = None, max_partners: int = 1) -> str | None:
        return self.registry.assign_draft(verify_id, tuple(exclude or ()), max_partners)

    def rebalance_draft(self, verify_id: str, max_partners: int = 1) -> str | None:
        return self.registry.rebalance(verify_id, max_partners)

    def ping(self) -> float:
        return self.scheduler.started_s

    def pid(self) -> int:
        return os.getpid()


def get_or_create_scheduler(name: str, namespace: str | None = None, labels: dict[str, str] | None = None) -> Any:
    """The cluster's scheduler actor, created on first use (any process may call this); `labels`: of its
    metrics (model_name, arm)."""
    # detached: its life must not end with the process that happened to create it first (an ingress or a
    # Serve replica that is later replaced); Ray restarts it if it dies
    return SchedulerActor.options(name=name, namespace=namespace, get_if_exists=True,
                                  lifetime="detached").remote(labels)


class SchedulerClient:
    """Non-blocking report/answer exchange with the named scheduler actor."""

    def __init__(self, name: str, namespace: str | None = None, answer_timeout_s: float = 5.0,
                 min_interval_s: float = 0.0) -> None:
        self.name, self.namespace = name, namespace
        self.answer_timeout_s = answer_timeout_s
        self.min_interval_s = min_interval_s  # reports at most this often (each is an actor call on both ends)
        self._handle: Any = None
        self._ref: Any = None
        self._sent_s = 0.0
        self.is_reachable = False
        self.num_failures = 0
        self.num_answers = 0

    def _actor(self) -> Any:
        if self._handle is None:
            try:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError:
                self.is_reachable = False
                return None
        return self._handle

    @property
    def is_due(self) -> bool:
        """Whether a report would go out now: none is waiting for its answer and the interval has passed."""
        return self._ref is None and time.perf_counter() - self._sent_s >= self.min_interval_s

    def report(self, load: WorkerLoad) -> None:
        if not self.is_due:
            return
        actor = self._actor()
        if actor is None:
            return
        self._ref = actor.report.remote(load)
        self._sent_s = time.perf_counter()

    def poll(self) -> CapacityDecision | None:
        """The answer to the last report if it has arrived; never waits."""
        if self._ref is None:
            return None
        ready, _ = ray.wait([self._ref], timeout=0)
        if not ready:
            if time.perf_counter() - self._sent_s > self.answer_timeout_s:
                self._fail("no answer in time")
            return None
        ref, self._ref = self._ref, None
        try:
            decision = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - actor died or restarting: fall back, retry later
            self._fail(repr(exc))
            return None
        self.is_reachable = True
        self.num_answers += 1
        return decision

    def _fail(self, why: str) -> None:
        if self.is_reachable:
            log.warning("scheduler %s unreachable (%s): local Algorithm 1 until it answers", self.name, why)
        self.is_reachable = False
        self.num_failures += 1
        self._ref = None
        self._handle = None
