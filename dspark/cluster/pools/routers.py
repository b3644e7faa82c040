"""Ray Serve request routers of the pools (Ray 2.60 `RequestRouter`), when the pools are Serve deployments.

- `PlacementRouter` (verify pool): each new request goes to the verify replica the SchedulerActor places
  it on, chosen among the replicas Serve can route to right now (so never a stopping or dead one). If
  the scheduler does not answer in time (restarting), the least-loaded candidates take it.
- `PinnedRouter` (draft pool): a call naming a replica in its `session_id` goes to that replica (a
  verify replica pairing with the draft replica the scheduler assigned); others to the least loaded.

Routers run in the caller's process (the ingress replica, or a verify replica pairing), one per process.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

log = logging.getLogger(__name__)


class _LeastLoaded(RequestRouter):
    def _queue_len(self, replica: RunningReplica) -> int:
        q = self.replica_queue_len_cache.get(replica.replica_id)
        return q if q is not None else 0

    def _least_loaded(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        return [sorted(candidates, key=self._queue_len)[:2]]


class PlacementRouter(_LeastLoaded):
    def initialize_state(self, scheduler_name: str = "", namespace: str = "dspark", timeout_s: float = 2.0,
                         **kwargs: object) -> None:
        self.scheduler_name, self.namespace, self.timeout_s = scheduler_name, namespace, timeout_s
        self._scheduler = None
        self.num_fallbacks = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        if pending_request.metadata.call_method != "generate":  # a probe or a stats call: nothing to place
            return self._least_loaded(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        try:
            if self._scheduler is None:
                self._scheduler = ray.get_actor(self.scheduler_name, namespace=self.namespace)
            chosen = await asyncio.wait_for(
                self._scheduler.place.remote(pending_request.metadata.request_id, sorted(by_id)), self.timeout_s)
            if chosen in by_id:
                return [[by_id[chosen]]]
        except Exception as exc:  # noqa: BLE001 - scheduler restarting or gone: place locally
            self._scheduler = None
            self.num_fallbacks += 1
            log.warning("scheduler did not place a request (%r): least-loaded fallback", exc)
        return self._least_loaded(candidate_replicas)


class PinnedRouter(_LeastLoaded):
    def initialize_state(self, pin_wait_s: float = 10.0, **kwargs: object) -> None:
        self.pin_wait_s = pin_wait_s

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # an empty answer retries with backoff
        target = pending_request.metadata.session_id
        if target:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if pinned:
                return [pinned]
            if time.time() - pending_request.created_at < self.pin_wait_s:
                return []  # just started, not routable yet: wait for it
        return self._least_loaded(candidate_replicas)
