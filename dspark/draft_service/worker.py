"""DraftWorker: a Ray actor that owns a drafter and each request's draft-side context.

Paired with one VerifyWorker. With the gloo transport it joins the pair's process group and answers
messages on a background thread (`serve_channel`); with the Ray transport the verify worker calls
`handle` directly. The drafter's frozen target pieces (embedding, LM head) are loaded on this worker's
device, so nothing but the per-step messages crosses between the two.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray
import torch

from dspark.actors.transport import GlooChannel
from dspark.cluster.config import ServeAppConfig
from dspark.draft_service.service import DraftService, DraftSpan, serve_channel
from dspark.models.drafter import make_drafter
from dspark.models.target import load_target
from dspark.verify_service.engine import resolve_dtype


class DraftWorker:
    def __init__(self, worker_id: str, config: ServeAppConfig) -> None:
        self.worker_id, self.config = worker_id, config
        torch.set_num_threads(config.draft_worker.threads())
        device = config.draft_device or ("cuda" if config.draft_worker.num_gpus else config.device)
        # the verify side's dtype (auto: measured for verification), so features arrive as the drafter expects
        target = load_target(config.target, device, resolve_dtype(config.engine_config()))
        drafter = make_drafter(config.drafter, target, **dict(config.drafter_kwargs))
        metrics = config.metrics("draft", worker_id)

        def on_span(span: DraftSpan, num_contexts: int) -> None:
            metrics.inc("dspark_draft_busy_seconds_total", span.end_s - span.start_s)
            metrics.set("dspark_draft_contexts", num_contexts)

        self.service = DraftService(drafter, on_span=on_span)
        metrics.refresh_every(lambda: metrics.set("dspark_draft_contexts", self.service.num_requests))
        self.channel: GlooChannel | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def ready(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "hidden_layers": list(self.service.hidden_layers)}

    def pair_gloo(self, host: str, port: int) -> None:
        """Join the verify worker's two-rank group (blocks until it joins too) and start answering. A
        re-pair (the verify side restarted, or this worker did) starts from no draft context."""
        if self.channel is not None:
            self.service.reset()
            self.error = None
        channel = self.channel = GlooChannel(host, port, 1)
        self._thread = threading.Thread(target=self._serve, args=(channel,), name="dspark-draft", daemon=True)
        self._thread.start()

    def _serve(self, channel: GlooChannel) -> None:
        try:
            serve_channel(channel, self.service)
        except Exception as exc:  # noqa: BLE001 - surfaced through stats() and is_alive()
            if channel is self.channel:  # not a link this worker has already replaced
                self.error = repr(exc)
                # the verify partner is gone, and with it every request this worker drafted for
                self.service.reset()

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """The Ray-transport path: one message in, its reply out."""
        if message.get("kind") == "ping":
            return {"kind": "pong", "seq": message.get("seq"), "payload": message.get("payload")}
        return self.service.handle(message)

    def pid(self) -> int:
        return os.getpid()

    def is_alive(self) -> bool:
        return self.error is None and (self._thread is None or self._thread.is_alive())

    def stats(self) -> dict[str, Any]:
        spans = self.service.timeline()[-512:]
        busy = sum(s["end_s"] - s["start_s"] for s in spans)
        return {"worker_id": self.worker_id, "num_messages": self.service.num_messages,
                "num_requests": self.service.num_requests, "timeline": spans, "error": self.error,
                "draft_ms_mean": 1e3 * busy / len(spans) if spans else 0.0}


# threaded: stats() answers while pair_gloo waits for the peer or the Ray-transport handle() runs
DraftWorkerActor = ray.remote(max_concurrency=4)(DraftWorker)
