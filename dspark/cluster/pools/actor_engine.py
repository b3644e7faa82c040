"""The ingress side of the pool modes: an AsyncEngine-shaped front over the VerifyWorker pool.

`generate` asks the SchedulerActor where to put the request (falling back to the least-loaded worker
known here when the scheduler does not answer in time, e.g. while Ray restarts it), then streams the
worker's outputs back through a Ray streaming actor call. Input is validated here, so a bad request is
a 400 without a round trip.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from transformers import AutoConfig, AutoTokenizer

from dspark.cluster.pools.actor_pools import Pools, pair, start_pools
from dspark.cluster.pools.resume import OpenedStream, resuming_stream
from dspark.config.serve import ServeAppConfig
from dspark.models.target.loader import resolve_target_path
from dspark.verify_service.async_engine import EngineDeadError
from dspark.verify_service.request import RequestOutput, SamplingParams, validate_request

log = logging.getLogger(__name__)


class ClusterEngine:
    def __init__(self, config: ServeAppConfig, place_timeout_s: float = 2.0) -> None:
        self.config = config
        path = resolve_target_path(config.target)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self.vocab_size = AutoConfig.from_pretrained(path).vocab_size
        self.pools: Pools = start_pools(config)
        metrics = config.metrics("ingress", "ingress")

        def pool_gauges() -> None:
            metrics.set("dspark_pool_replicas", len(self.pools.verify), pool="verify")
            metrics.set("dspark_pool_replicas", len(self.pools.draft), pool="draft")

        metrics.refresh_every(pool_gauges)
        self.place_timeout_s = place_timeout_s
        self.outstanding = dict.fromkeys(self.pools.verify, 0)
        self.num_fallback_placements = 0
        self.num_resumed = 0  # requests resumed on another verify worker after theirs died
        self.num_worker_failures = 0
        self.num_repairs = 0
        self.down: dict[str, float] = {}  # verify workers not to place on (dead or restarting), since when
        self.heal_interval_s = 1.0
        self._draft_pids = {did: self.pools.info[did]["pid"] for did in self.pools.draft}
        self._is_shut_down = False
        self._error: str | None = None
        self._healer = threading.Thread(target=self._heal_loop, name="dspark-healer", daemon=True)
        self._healer.start()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def is_alive(self) -> bool:
        return self._error is None

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The same client errors as `Engine.validate`, checked before anything is sent."""
        validate_request(prompt_ids, params, self.config.num_draft_tokens, self.config.max_model_len,
                         self.vocab_size)

    def available(self) -> list[str]:
        return [w for w in self.pools.verify if w not in self.down]

    async def place(self, request_id: str) -> str:
        workers = self.available()
        if not workers:
            raise EngineDeadError("no verify worker is available")
        try:
            worker = await asyncio.wait_for(self.pools.scheduler.place.remote(request_id, workers),
                                            timeout=self.place_timeout_s)
            if worker in workers:
                return worker
        except Exception as exc:  # noqa: BLE001 - scheduler down or restarting: place locally
            log.warning("scheduler did not place %s (%r): least-loaded fallback", request_id, exc)
        self.num_fallback_placements += 1
        return min(workers, key=lambda w: self.outstanding[w])

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request from the verify worker the scheduler picks; if that worker dies, it resumes on
        another one (resume.py)."""
        self.validate(prompt_ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex}"

        def failed(worker_id: str) -> None:
            self.mark_down(worker_id)
            self.num_resumed += 1

        async for out in resuming_stream(self._open, prompt_ids, params, rid, len(self.pools.verify) + 2, failed):
            yield out

    async def _open(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> OpenedStream:
        worker_id = await self.place(rid)
        stream = self.pools.verify[worker_id].generate.options(num_returns="streaming").remote(
            prompt_ids, params, rid)

        async def outputs() -> AsyncIterator[RequestOutput]:
            self.outstanding[worker_id] += 1
            try:
                async for ref in stream:
                    yield await ref
            finally:
                self.outstanding[worker_id] -= 1

        return OpenedStream(outputs(), lambda: ray.cancel(stream), worker_id)

    # ---- healing -------------------------------------------------------------------------------------
    def mark_down(self, worker_id: str) -> None:
        if worker_id not in self.down:
            self.down[worker_id] = time.monotonic()
            self.num_worker_failures += 1

    def _heal_loop(self) -> None:
        """Daemon thread: brings restarted verify workers back (re-paired), re-pairs verify workers whose
        draft worker was replaced. Ray restarts dead workers (max_restarts); this reconnects them."""
        while not self._is_shut_down:
            try:
                self._heal_once()
            except Exception:  # noqa: BLE001 - the healer must outlive anything it meets
                log.exception("pool healer pass failed")
            time.sleep(self.heal_interval_s)

    def _heal_once(self) -> None:
        decoupled = self.config.mode == "decoupled"
        for vid, handle in self.pools.verify.items():
            try:
                state = ray.get(handle.pair_state.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - dead, or restarting
                self.mark_down(vid)
                continue
            did = self.pools.pairs.get(vid)
            if decoupled and did is not None and not state["reconnect_pending"]:
                draft = self.pools.draft[did]
                try:
                    info = ray.get(draft.ready.remote(), timeout=5)
                except Exception:  # noqa: BLE001 - the draft worker is not back yet: next pass
                    info = None
                # a restarted draft worker (new pid) must be re-paired even before the verify side notices
                replaced = info is not None and info["pid"] != self._draft_pids.get(did)
                if info is not None and (not state["is_serving"] or state["draft_broken"] or replaced):
                    try:
                        pair(handle, draft, did, info["hidden_layers"], self.config.transport, timeout_s=60)
                    except Exception as exc:  # noqa: BLE001 - try again next pass
                        log.info("re-pairing %s with %s failed for now: %r", vid, did, exc)
                        continue
                    self._draft_pids[did] = info["pid"]
                    self.num_repairs += 1
                    log.info("re-paired %s with %s", vid, did)
                    continue  # serving (or switched over) from the next pass on
            if vid in self.down and state["is_serving"] and not state["reconnect_pending"]:
                log.info("verify worker %s is back after %.1f s", vid, time.monotonic() - self.down[vid])
                del self.down[vid]

    def stats(self) -> dict[str, Any]:
        """Per-worker timelines and the scheduler's decisions, for `/v1/dspark/stats` and the benchmark."""
        handles = {**self.pools.verify, **self.pools.draft}
        refs = {wid: h.stats.remote() for wid, h in handles.items()}
        out: dict[str, Any] = {"mode": self.config.mode, "transport": self.config.transport,
                               "pairs": self.pools.pairs, "num_fallback_placements": self.num_fallback_placements,
                               "num_resumed": self.num_resumed, "num_worker_failures": self.num_worker_failures,
                               "num_repairs": self.num_repairs, "down": sorted(self.down),
                               "nodes": {w: i["node_id"] for w, i in self.pools.info.items()}, "workers": {}}
        for wid, ref in refs.items():
            try:
                out["workers"][wid] = ray.get(ref, timeout=10)
            except Exception as exc:  # noqa: BLE001 - report, do not fail the stats call
                out["workers"][wid] = {"error": repr(exc)}
        try:
            out["scheduler"] = ray.get(self.pools.scheduler.snapshot.remote(), timeout=5)
        except Exception as exc:  # noqa: BLE001
            out["scheduler"] = {"error": repr(exc)}
        return out

    def shutdown(self) -> None:
        self._is_shut_down = True
        for h in self.pools.verify.values():
            h.shutdown.remote()
        if self._healer is not threading.current_thread():
            # a pass in flight finishes first: after this returns, nothing of this engine calls Ray (a call
            # after ray.shutdown() would connect this process to whatever cluster runs next)
            self._healer.join(timeout=2 * self.heal_interval_s + 15)
