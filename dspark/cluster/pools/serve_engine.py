"""The ingress side of `pools: serve`: an AsyncEngine-shaped front over one arm's verify deployment.

Each request is a streaming call on the verify deployment's handle; `PlacementRouter` puts it on the
replica the SchedulerActor places it on. A replica that dies (or is killed) mid-stream: the request resumes
on another from its committed tokens (resume.py). Input is validated here, so a bad request is a 400
without a round trip. `is_ready`: whether the pool would answer now (readiness.py), so the HTTP front
answers 503 + Retry-After while the pool warms up instead of queueing or failing.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from transformers import AutoConfig, AutoTokenizer

from dspark.cluster.pools.readiness import ReadinessProbe
from dspark.cluster.pools.resume import OpenedStream, resuming_stream
from dspark.cluster.pools.serve_pools import NAMESPACE, scheduler_name
from dspark.config.serve import ServeAppConfig
from dspark.models.target.loader import resolve_target_path
from dspark.verify_service.request import RequestOutput, SamplingParams, validate_request

log = logging.getLogger(__name__)


class ServePoolEngine:
    def __init__(self, config: ServeAppConfig, verify_pool: Any) -> None:
        self.config = config
        path = resolve_target_path(config.target)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self.vocab_size = AutoConfig.from_pretrained(path).vocab_size
        self.verify_pool = verify_pool.options(stream=True)
        self.readiness = ReadinessProbe(lambda: self._probe(verify_pool))
        self.num_resumed = 0
        self.num_verify_replicas = 1  # live verify replicas, as the scheduler last listed them (admission reads it)
        metrics = config.metrics("ingress", "ingress")
        metrics.refresh_every(self._pool_gauges(metrics), interval_s=2.0)

    def _pool_gauges(self, metrics: Any) -> Any:
        def set_gauges() -> None:
            live = self._live()
            if live:
                self.num_verify_replicas = max(1, len(live.get("verify", {})))
            metrics.set("dspark_pool_replicas", len(live.get("verify", {})), pool="verify")
            if self.config.mode == "decoupled":
                metrics.set("dspark_pool_replicas", len(live.get("draft", {})), pool="draft")
        return set_gauges

    def _scheduler(self) -> Any:
        return ray.get_actor(scheduler_name(self.config), namespace=NAMESPACE)

    def _live(self) -> dict:
        try:
            return ray.get(self._scheduler().snapshot.remote(), timeout=10)["replicas"]
        except Exception:  # noqa: BLE001 - scheduler restarting
            return {}

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def is_alive(self) -> bool:
        return True  # the replicas' health is Serve's: a dead one is replaced, its requests resumed

    async def is_ready(self) -> bool:
        """Whether a request would be answered now: a live verify replica answered the readiness probe."""
        return await self.readiness.is_ready()

    @staticmethod
    async def _probe(verify_pool: Any) -> None:
        response = verify_pool.ready_probe.remote()
        try:
            await response
        except BaseException:
            response.cancel()  # no replica to take it yet: do not leave it queued in the router
            raise

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_ids, params, self.config.num_draft_tokens, self.config.max_model_len,
                         self.vocab_size)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        self.validate(prompt_ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex}"

        def failed(_: str) -> None:
            self.num_resumed += 1

        max_attempts = self.config.num_verify_workers + 4
        async for out in resuming_stream(self._open, prompt_ids, params, rid, max_attempts, failed):
            yield out

    async def _open(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> OpenedStream:
        gen = self.verify_pool.generate.remote(prompt_ids, params, rid)
        return OpenedStream(gen.__aiter__(), gen.cancel, "")

    def stats(self) -> dict[str, Any]:
        """The scheduler's view (replicas, pairs, K, placements) and each live verify replica's stats."""
        out: dict[str, Any] = {"mode": self.config.mode, "pools": "serve", "num_resumed": self.num_resumed,
                               "workers": {}}
        try:
            out["scheduler"] = ray.get(self._scheduler().snapshot.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001
            out["scheduler"] = {"error": repr(exc)}
        return out

    def shutdown(self) -> None:
        pass
