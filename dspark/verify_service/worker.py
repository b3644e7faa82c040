"""VerifyWorker: a Ray actor that owns a target model, its KV cache, and the step loop of the requests
placed on it.

In `colocated` mode its drafter is in-process; in `decoupled` mode the drafter is a `RemoteDrafter`
on a channel to the paired DraftWorker (gloo point-to-point, or Ray object refs). The engine is a
`PipelinedEngine` (micro-batches in ping-pong) behind an `AsyncEngine`; `generate` is a streaming
actor method. After every step the worker reports its load to the central scheduler and, with the
`central` scheduler, applies the capacity K it answers (local Algorithm 1 while there is none).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch

from dspark.actors.cluster_scheduler import WorkerLoad
from dspark.actors.scheduler_actor import SchedulerClient
from dspark.actors.transport import PairChannel, RayChannel, free_port, node_ip, open_channel
from dspark.config.engine import resolve_dtype
from dspark.config.serve import ServeAppConfig
from dspark.draft_service.client import RemoteDrafter
from dspark.kernels import omp_teams
from dspark.models.drafters.registry import make_drafter
from dspark.models.target.loader import load_target
from dspark.verify_service.async_engine import AsyncEngine
from dspark.verify_service.engine_stats import NUM_TIMELINE_STEPS, engine_stats
from dspark.verify_service.metrics import EngineMetrics
from dspark.verify_service.pipelined_engine import PipelinedEngine
from dspark.verify_service.request import RequestOutput, SamplingParams
from dspark.verify_service.step.capacity import CentralCapacity

log = logging.getLogger(__name__)


class VerifyWorker:
    def __init__(self, worker_id: str, config: ServeAppConfig) -> None:
        self.worker_id, self.config = worker_id, config
        engine_cfg = config.worker_engine_config()
        config.verify_worker.apply_nice()
        torch.set_num_threads(engine_cfg.num_threads or 1)
        target = load_target(engine_cfg.target, engine_cfg.device, resolve_dtype(engine_cfg))
        drafter = None
        if config.mode == "colocated":
            drafter = make_drafter(config.drafter, target, **dict(config.drafter_kwargs))
        self.engine = PipelinedEngine(engine_cfg, target=target, drafter=drafter,
                                      num_micro_batches=config.micro_batches)
        self.capacity: CentralCapacity | None = None
        if config.scheduler == "central":
            self.capacity = CentralCapacity()
            self.engine.set_scheduler(self.capacity)
        self.scheduler_client = SchedulerClient(f"{config.cluster_name}-scheduler", "dspark",
                                                min_interval_s=config.scheduler_report_interval_ms / 1e3)
        self.draft_worker: str | None = None
        self.channel: PairChannel | RayChannel | None = None
        self._pending_channel: tuple[str, int] | None = None
        self._reconnect: tuple[str, PairChannel] | None = None
        self._paired_at_step = -1  # K decided from reports up to this step describe a drafter since replaced
        self.rebuilt = {"positions": 0, "ms": 0.0}  # draft contexts recomputed for re-paired draft workers
        self._sent_profile = False
        self.async_engine: AsyncEngine | None = None
        self.engine_metrics = EngineMetrics(config.metrics("verify", worker_id))
        if config.mode == "colocated":
            self._start()

    # ---- lifecycle and pairing -----------------------------------------------------------------
    def ready(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "paired_with": self.draft_worker, "is_serving": self.async_engine is not None}

    def channel_address(self) -> tuple[str, int]:
        """Where the paired DraftWorker meets this worker's channel (this worker hosts it: the socket's listener
        or the gloo group's store)."""
        self._pending_channel = (node_ip(), free_port())
        return self._pending_channel

    async def pair_channel(self, draft_worker: str, hidden_layers: list[int]) -> None:
        if self._pending_channel is None:
            raise RuntimeError("call channel_address first")
        host, port = self._pending_channel
        channel = await asyncio.to_thread(open_channel, self.config.transport, host, port, 0)
        if self.async_engine is not None and isinstance(self.engine.drafter, RemoteDrafter):
            # serving already (the draft partner was replaced): the engine thread switches between steps
            self._reconnect = (draft_worker, channel)
            self.async_engine.wake()
            return
        self._attach(draft_worker, channel, hidden_layers)

    def pair_state(self) -> dict[str, Any]:
        """Whether this worker serves, and whether its draft link is broken (for the ingress's healer)."""
        drafter = self.engine.drafter
        return {"is_serving": self.async_engine is not None, "paired_with": self.draft_worker,
                "draft_broken": isinstance(drafter, RemoteDrafter) and drafter.is_broken,
                "reconnect_pending": self._reconnect is not None}

    def _apply_reconnect(self) -> None:
        """On the engine thread: swap the broken draft link for the new one."""
        if self._reconnect is None:
            return
        draft_worker, channel = self._reconnect
        self._reconnect = None
        old = self.channel
        self.channel, self.draft_worker = channel, draft_worker
        drafter = self.engine.drafter
        if isinstance(drafter, RemoteDrafter):
            drafter.reconnect(channel)
        if self.capacity is not None:  # a K set while unpaired (0: no drafts) must not hold back the new drafter
            self.capacity.reset()
            self._paired_at_step = self.engine.num_steps
        t0 = time.perf_counter()
        n = self.engine.rebuild_draft_contexts()  # the new peer starts empty: give it the running contexts
        ms = (time.perf_counter() - t0) * 1e3
        self.rebuilt = {"positions": self.rebuilt["positions"] + n, "ms": self.rebuilt["ms"] + ms}
        log.info("%s re-paired with %s (was %s); %d context positions rebuilt in %.0f ms", self.worker_id,
                 draft_worker, old, n, ms)

    def pair_ray(self, draft_worker: str, draft_handle: Any, hidden_layers: list[int]) -> None:
        self._attach(draft_worker, RayChannel(draft_handle), hidden_layers)

    def _attach(self, draft_worker: str, channel: PairChannel | RayChannel, hidden_layers: list[int]) -> None:
        if self.async_engine is not None:
            raise RuntimeError(f"{self.worker_id} is already serving (paired with {self.draft_worker})")
        self.channel, self.draft_worker = channel, draft_worker
        # on a CPU with one micro-batch (each round is collected right after it was sent), the wait for a reply
        # frees this process's OpenMP team first: its threads would spin on the cores the draft worker needs to
        # answer (GNU OpenMP spins ~10 ms for the next parallel region). Session 43, 2-core Xeon, a bf16 SmolLM2
        # step then a gloo round trip to a process drafting 0.3 ms: 4.5 ms spinning, 2.0-2.5 ms released
        # (the release 0.1 ms; the next step no slower). Two micro-batches: the reply is usually in already.
        on_block = (omp_teams.release if self.config.free_threads_while_drafting and self.config.micro_batches == 1
                    and self.engine.runner.device.type == "cpu" else None)
        self.engine.set_drafter(RemoteDrafter(channel, tuple(hidden_layers), name=self.config.drafter,
                                              on_block=on_block))
        self._start()

    def _start(self) -> None:
        self.async_engine = AsyncEngine(self.engine, on_step=self._after_step, on_idle=self._on_idle)

    def _on_idle(self) -> None:
        self._apply_reconnect()
        self.engine_metrics.after_step(self.engine)

    # ---- serving ---------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if self.async_engine is None:
            raise RuntimeError(f"{self.worker_id} is not paired with a draft worker yet")
        async for out in self.async_engine.generate(prompt_ids, params, request_id):
            yield out

    def pid(self) -> int:
        return os.getpid()

    def is_alive(self) -> bool:
        return self.async_engine is not None and self.async_engine.is_alive

    # ---- scheduler exchange (engine thread) -------------------------------------------------------
    def _after_step(self) -> None:
        self._apply_reconnect()
        self.engine_metrics.after_step(self.engine)
        decision = self.scheduler_client.poll()
        if decision is not None and self.capacity is not None and decision.based_on_step > self._paired_at_step:
            self.capacity.set_capacity(decision.capacity)
        if self.scheduler_client.is_due:
            self.scheduler_client.report(self.load())

    def load(self) -> WorkerLoad:
        eng = self.engine
        recent = eng.stats[-8:]
        step_ms = sum(s.verify_ms for s in recent) / len(recent) if recent else 0.0
        tokens = sum(s.num_tokens for s in recent) / len(recent) if recent else 0.0
        survival = self.capacity.last_survival if self.capacity is not None else []
        profile = None
        if not self.scheduler_client.is_reachable and eng.sps is not None:
            profile = eng.sps.to_dict()  # (re)send until a scheduler has answered: it may have restarted
        return WorkerLoad(self.worker_id, len(eng.running), len(eng.waiting), eng.config.max_num_seqs,
                          eng.num_steps, step_ms, tokens, survival, profile, self.draft_worker)

    # ---- observability -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        eng = self.engine
        out: dict[str, Any] = {
            "worker_id": self.worker_id, "mode": self.config.mode, "draft_worker": self.draft_worker,
            "transport": self.config.transport if self.config.mode == "decoupled" else "in-process",
            **engine_stats(eng),
            "at_s": time.time(), "reconnect_pending": self._reconnect is not None,
            "contexts_rebuilt": dict(self.rebuilt),
            "scheduler_reachable": self.scheduler_client.is_reachable,
            "scheduler_failures": self.scheduler_client.num_failures,
        }
        if self.capacity is not None:
            out["capacity"] = {"last_k": self.capacity.capacity, "num_central_steps": self.capacity.num_central_steps,
                               "num_fallback_steps": self.capacity.num_fallback_steps}
        drafter = eng.drafter
        if isinstance(drafter, RemoteDrafter) and drafter.spans:
            spans = list(drafter.spans)[-NUM_TIMELINE_STEPS:]
            out["transport_ms_mean"] = sum(s.transport_ms for s in spans) / len(spans)
            out["num_blocked_rounds"] = drafter.num_blocked_rounds  # rounds collect may have waited for
            out["draft_wait_ms_mean"] = sum(s.exposed_ms for s in spans) / len(spans)
            out["draft_timeline"] = [{"seq": s.seq, "start_s": s.draft_start_s, "end_s": s.draft_end_s,
                                      "num_requests": s.num_requests} for s in spans]
        if isinstance(drafter, RemoteDrafter):
            out["draft_channel_error"] = drafter.error  # None while the pair works
        if isinstance(drafter, RemoteDrafter) and drafter.push_ms:
            pushes = list(drafter.push_ms)
            out["num_pushes"], out["push_ms_mean"] = len(pushes), sum(pushes) / len(pushes)
        if isinstance(drafter, RemoteDrafter) and eng.num_steps:
            # all transport (rounds and pushes) spread over all steps, undrafted ones included
            out["transport_ms_per_step"] = drafter.total_transport_ms / eng.num_steps
        return out

    def shutdown(self) -> None:
        if self.async_engine is not None:
            self.async_engine.shutdown()
        if self.channel is not None:
            try:
                self.channel.send({"kind": "close"})
            except Exception:  # noqa: BLE001 - the peer may be gone already
                pass


VerifyWorkerActor = ray.remote(VerifyWorker)
