"""The verify and draft pools as Ray Serve deployments (`pools: serve`): Serve starts, heals and autoscales
them like any deployment; `serve status` lists them as `<arm>-verify` and `<arm>-draft`.

- Every replica announces itself to the arm's SchedulerActor with a heartbeat (registry.py) and leaves
  when Serve stops it, after Serve has drained its streams (`graceful_shutdown_timeout_s`).
- A replica is up (and healthy) only once it can answer: its constructor loads the target and everything it
  needs (prepared once per machine: `dspark prepare`, `kernels/cache_once.py`), and its engine steps before
  it returns; the ingress probes it (`ready_probe`, readiness.py) before it calls itself ready. A replica
  that cannot start fails with one line naming the cause and the fix.
- A verify replica serves at once, target-only; in decoupled mode it asks the scheduler for a free draft
  replica, pairs with it over gloo (the call reaches that replica through `PinnedRouter`) and switches to
  it between two steps. When the draft replica dies or is scaled away it goes back to target-only
  (lossless by construction) and pairs again with another one.
- Requests reach a verify replica through `PlacementRouter`: the scheduler places each one among the
  replicas Serve can route to.
- `record_autoscaling_stats` gives the application-level policy (autoscale/serve_policy.py) each pool's
  own signals.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from dspark.actors.scheduler_actor import get_or_create_scheduler
from dspark.actors.transport import open_channel
from dspark.config.serve import ServeAppConfig
from dspark.draft_service.client import RemoteDrafter
from dspark.draft_service.worker import DraftWorker
from dspark.kernels.cache_once import PrepareError, explain
from dspark.models.drafters.registry import hidden_layers_of
from dspark.verify_service.request import RequestOutput, SamplingParams
from dspark.verify_service.worker import VerifyWorker

log = logging.getLogger(__name__)
_REBALANCE_EVERY_S = 5.0  # how often a paired verify replica asks whether to move to another draft replica
_PAIR_RETRY_AFTER_S = 10.0  # how long a draft replica that failed to pair is passed over

HEARTBEAT_S = 2.0
NAMESPACE = "dspark"


def replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


def scheduler_name(config: ServeAppConfig) -> str:
    return f"{config.cluster_name}-scheduler"


def _scheduler(config: ServeAppConfig) -> Any:
    return get_or_create_scheduler(scheduler_name(config), NAMESPACE,
                                   {"model_name": config.model_name or config.target, "arm": config.arm_name,
                                    "replica": scheduler_name(config)})


class _Heartbeat:
    """Announce this replica every HEARTBEAT_S until stopped (the scheduler may restart: it relearns us)."""

    def __init__(self, config: ServeAppConfig, pool: str, rid: str, info: Any) -> None:
        self.config, self.pool, self.rid, self.info = config, pool, rid, info
        self.is_stopped = False
        threading.Thread(target=self._run, name=f"dspark-{pool}-heartbeat", daemon=True).start()

    def _run(self) -> None:
        handle = None
        while not self.is_stopped:
            try:
                handle = handle or _scheduler(self.config)  # looked up once, again only after a failure
                ray.get(handle.heartbeat.remote(self.pool, self.rid, self.info()), timeout=10)
            except Exception as exc:  # noqa: BLE001 - the scheduler is restarting; try again
                handle = None
                log.info("heartbeat to the scheduler failed: %r", exc)
            time.sleep(HEARTBEAT_S)

    def leave(self) -> None:
        self.is_stopped = True
        try:
            _scheduler(self.config).leave.remote(self.rid)
        except Exception:  # noqa: BLE001 - best effort: the registry forgets us after its TTL anyway
            pass


def _started(pool: str, config: ServeAppConfig, start: Any) -> None:
    """Run a replica's start; a failure becomes one line naming its cause and fix (Serve shows it in the log
    and in `serve status`)."""
    try:
        start()
    except Exception as exc:
        raise PrepareError(f"{config.arm_name}-{pool} replica cannot start: {explain(exc, 'loading')}") from exc


class VerifyReplica(VerifyWorker):
    def __init__(self, config: ServeAppConfig, draft_pool: Any | None = None) -> None:
        rid = replica_id()
        _scheduler(config)
        _started("verify", config, lambda: VerifyWorker.__init__(self, rid, config))
        self.draft_pool = draft_pool
        self._timings: deque[tuple[float, float]] = deque(maxlen=256)  # (ttft_s, tpot_s) of finished requests
        if config.mode == "decoupled":
            # target-only until paired: the drafter's feature taps are known now (from its checkpoint's config,
            # without loading it), so features flow from the start
            taps = hidden_layers_of(config.drafter, self.engine.target, **dict(config.drafter_kwargs))
            self.engine.set_drafter(RemoteDrafter.unpaired(taps, name=config.drafter))
            self._taps = list(taps)
        # the first heartbeat comes after the unpaired drafter is in place: never "paired" before it is
        self.heartbeat = _Heartbeat(config, "verify", rid, lambda: {
            "draft_partner": self.draft_worker, "pid": os.getpid(), "num_running": len(self.engine.running),
            "num_waiting": len(self.engine.waiting), "draft_broken": self.pair_state()["draft_broken"],
            "contexts_rebuilt": self.rebuilt["positions"], "rebuild_ms": round(self.rebuilt["ms"], 1)})
        if config.mode == "decoupled":
            self._start()
            threading.Thread(target=self._pair_loop, name="dspark-pairing", daemon=True).start()

    # ---- serving ---------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        t0 = time.perf_counter()
        first_s, n = None, 0
        async for out in super().generate(prompt_ids, params, request_id):
            if first_s is None:
                first_s = time.perf_counter()
            n += len(out.new_token_ids)
            yield out
        if first_s is not None:
            self._timings.append((first_s - t0, (time.perf_counter() - first_s) / max(n - 1, 1)))

    def check_health(self) -> None:
        if self.async_engine is None or not self.async_engine.is_alive:
            raise RuntimeError("engine loop is not running")

    def ready_probe(self) -> bool:
        """The ingress's readiness probe (readiness.py): answers only once this replica can serve."""
        self.check_health()
        return True

    def record_autoscaling_stats(self) -> dict[str, float]:
        eng = self.engine
        now = time.time()
        recent = [s for s in eng.stats[-64:] if now - s.end_s < 5.0]  # an idle replica reports 0
        timings = list(self._timings)[-64:]
        drafter = eng.drafter
        spans = [s for s in list(getattr(drafter, "spans", []))[-64:] if now - s.collect_end_s < 5.0]
        return {
            "tokens_per_step": sum(s.num_tokens for s in recent) / len(recent) if recent else 0.0,
            "queue_depth": float(len(eng.waiting)),
            "num_running": float(len(eng.running)),
            "ttft_p50_s": statistics.median(t for t, _ in timings) if timings else 0.0,
            "tpot_p50_s": statistics.median(t for _, t in timings) if timings else 0.0,
            "draft_wait_ms": sum(s.exposed_ms for s in spans) / len(spans) if spans else 0.0,
            "is_unpaired": float(isinstance(drafter, RemoteDrafter) and drafter.is_broken),
            # the SLA this arm serves under (args.sla, the one place it is set): the policy compares with it
            "sla_ttft_s": self.config.sla.ttft_s,
            "sla_tpot_s": self.config.sla.tpot_s,
        }

    # ---- pairing (decoupled) ---------------------------------------------------------------------
    def _pair_loop(self) -> None:
        """Pairs while unpaired; while paired, asks every few seconds whether to move to another draft
        replica (the draft pool grew, or the partner drains): the switch happens between two steps."""
        failed: dict[str, float] = {}  # draft replica -> when pairing with it last failed
        last_rebalance = time.monotonic()
        while not self.heartbeat.is_stopped:
            state = self.pair_state()
            if self.draft_pool is not None and not state["reconnect_pending"]:
                try:
                    if state["draft_broken"]:
                        self._pair_once(failed)
                    elif time.monotonic() - last_rebalance >= _REBALANCE_EVERY_S:
                        last_rebalance = time.monotonic()
                        did = ray.get(_scheduler(self.config).rebalance_draft.remote(
                            self.worker_id, self.config.max_verify_per_draft), timeout=10)
                        if did is not None:
                            log.info("%s: moving from draft replica %s to %s", self.worker_id, self.draft_worker,
                                     did)
                            self._pair_once(failed, did)
                except Exception as exc:  # noqa: BLE001 - that draft replica is gone: another next time
                    log.warning("%s: pairing failed (%r); serving on target-only until the next try",
                                self.worker_id, exc)
            time.sleep(1.0)

    def _pair_once(self, failed: dict[str, float], did: str | None = None) -> None:
        if did is None:
            # a draft replica that failed to pair is passed over for a while, not for good: with one draft
            # replica (or a pool that failed together while busy) a permanent exclusion meant target-only
            # for the replica's whole life
            now = time.monotonic()
            recent = [d for d, at in failed.items() if now - at < _PAIR_RETRY_AFTER_S]
            did = ray.get(_scheduler(self.config).assign_draft.remote(
                self.worker_id, recent, self.config.max_verify_per_draft), timeout=10)
        if did is None:
            return
        host, port = self.channel_address()
        reply = self.draft_pool.options(session_id=did).pair_channel.remote(host, port)
        try:
            channel = open_channel(self.config.transport, host, port, 0)  # blocks until the draft replica joins
            reply.result(timeout_s=60)
        except Exception:
            failed[did] = time.monotonic()
            raise
        self._reconnect = (did, channel)
        if self.async_engine is not None:
            self.async_engine.wake()

    def __del__(self) -> None:
        heartbeat = getattr(self, "heartbeat", None)
        if heartbeat is not None:
            heartbeat.leave()
        if hasattr(self, "async_engine"):  # a replica whose start failed has nothing to shut down
            self.shutdown()


class DraftReplica(DraftWorker):
    def __init__(self, config: ServeAppConfig) -> None:
        rid = replica_id()
        _scheduler(config)
        _started("draft", config, lambda: DraftWorker.__init__(self, rid, config))
        self._busy: deque[tuple[float, float]] = deque(maxlen=4096)
        self.heartbeat = _Heartbeat(config, "draft", rid, lambda: {"num_contexts": self.service.num_requests,
                                                                   "pid": os.getpid(), "num_links": self.num_links})

    async def pair_channel(self, host: str, port: int) -> list[int]:  # type: ignore[override]
        """Pair with the verify replica that called (blocks until both sides joined); its feature taps."""
        await asyncio.to_thread(DraftWorker.pair_channel, self, host, port)
        return list(self.service.hidden_layers)

    def check_health(self) -> None:
        pass  # a broken link is its verify partner's death, not this replica's: it keeps serving the others

    def record_autoscaling_stats(self) -> dict[str, float]:
        spans = self.service.timeline()[-256:]
        now = time.time()
        window = [s for s in spans if now - s["end_s"] < 10.0]
        busy = sum(s["end_s"] - s["start_s"] for s in window)
        return {"utilisation": min(1.0, busy / 10.0), "num_contexts": float(self.service.num_requests)}

    def __del__(self) -> None:
        heartbeat = getattr(self, "heartbeat", None)
        if heartbeat is not None:
            heartbeat.leave()


def pool_deployments(config: ServeAppConfig) -> Any:
    """The bound verify deployment of one arm (and its draft deployment, in decoupled mode)."""
    from ray.serve.config import RequestRouterConfig

    from dspark.cluster.pools.routers import PinnedRouter, PlacementRouter

    arm = config.arm_name
    draft_app = None
    if config.mode == "decoupled":
        draft_opts = _scaling(config.draft_autoscaling, config.num_draft_workers)
        draft_app = serve.deployment(DraftReplica).options(
            name=f"{arm}-draft", ray_actor_options=config.draft_worker.actor_options(), max_ongoing_requests=8,
            health_check_period_s=2.0, health_check_timeout_s=30.0,
            request_router_config=RequestRouterConfig(request_router_class=PinnedRouter), **draft_opts,
        ).bind(config)
    verify_opts = _scaling(config.verify_autoscaling, config.num_verify_workers)
    return serve.deployment(VerifyReplica).options(
        name=f"{arm}-verify", ray_actor_options=config.verify_worker.actor_options(),
        max_ongoing_requests=config.max_num_seqs + config.max_queued_requests + 16,
        graceful_shutdown_timeout_s=config.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        request_router_config=RequestRouterConfig(
            request_router_class=PlacementRouter,
            request_router_kwargs={"scheduler_name": scheduler_name(config), "namespace": NAMESPACE}),
        **verify_opts,
    ).bind(config, draft_app)


def _scaling(autoscaling: dict | None, num_replicas: int) -> dict[str, Any]:
    if autoscaling:
        return {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 0.0,
                                       "downscale_delay_s": 0.0, "metrics_interval_s": 1.0,
                                       "look_back_period_s": 5.0, **autoscaling}}
    return {"num_replicas": num_replicas}

