"""The ingress side of the pool modes: an AsyncEngine-shaped front over the VerifyWorker pool.

`generate` asks the SchedulerActor where to put the request (falling back to the least-loaded worker
known here when the scheduler does not answer in time, e.g. while Ray restarts it), then streams the
worker's outputs back through a Ray streaming actor call. Input is validated here, so a bad request is
a 400 without a round trip.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from transformers import AutoConfig, AutoTokenizer

from dspark.actors.pools import Pools, start_pools
from dspark.cluster.config import ServeAppConfig
from dspark.models.target import resolve_target_path
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
        self._error: str | None = None

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

    async def place(self, request_id: str) -> str:
        workers = list(self.pools.verify)
        try:
            return await asyncio.wait_for(self.pools.scheduler.place.remote(request_id, workers),
                                          timeout=self.place_timeout_s)
        except Exception as exc:  # noqa: BLE001 - scheduler down or restarting: place locally
            self.num_fallback_placements += 1
            log.warning("scheduler did not place %s (%r): least-loaded fallback", request_id, exc)
            return min(workers, key=lambda w: self.outstanding[w])

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        self.validate(prompt_ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        worker_id = await self.place(rid)
        self.outstanding[worker_id] += 1
        stream = self.pools.verify[worker_id].generate.options(num_returns="streaming").remote(
            prompt_ids, params, rid)
        finished = False
        try:
            async for ref in stream:
                out: RequestOutput = await ref
                yield out
                if out.is_finished:
                    finished = True
                    return
        finally:
            self.outstanding[worker_id] -= 1
            if not finished:  # client gone: cancel the worker-side generator, which aborts the request
                ray.cancel(stream)

    def stats(self) -> dict[str, Any]:
        """Per-worker timelines and the scheduler's decisions, for `/v1/dspark/stats` and the benchmark."""
        handles = {**self.pools.verify, **self.pools.draft}
        refs = {wid: h.stats.remote() for wid, h in handles.items()}
        out: dict[str, Any] = {"mode": self.config.mode, "transport": self.config.transport,
                               "pairs": self.pools.pairs, "num_fallback_placements": self.num_fallback_placements,
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
        for h in self.pools.verify.values():
            h.shutdown.remote()
