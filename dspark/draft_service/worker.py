"""DraftWorker: a Ray actor that owns a drafter and each request's draft-side context.

Paired with one VerifyWorker. With the socket or gloo transport it joins the pair's channel and answers
messages on a background thread (`serve_channel`); with the Ray transport the verify worker calls
`handle` directly. The drafter's frozen target pieces (embedding, LM head) are loaded on this worker's
device, so nothing but the per-step messages crosses between the two.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray
import torch

from dspark.actors.transport import PairChannel, open_channel
from dspark.config.engine import resolve_dtype
from dspark.config.serve import ServeAppConfig
from dspark.draft_service.service import DraftService, DraftSpan, serve_channel
from dspark.kernels import omp_teams
from dspark.models.drafters.registry import make_drafter
from dspark.models.target.loader import load_target

log = logging.getLogger(__name__)


class DraftWorker:
    def __init__(self, worker_id: str, config: ServeAppConfig) -> None:
        self.worker_id, self.config = worker_id, config
        config.draft_worker.apply_nice()
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
        self.links: dict[int, tuple[PairChannel, threading.Thread]] = {}  # one per verify partner (M:N)
        self._next_link = 0
        self.error: str | None = None  # the last link that broke, until a new one is made

    def ready(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "hidden_layers": list(self.service.hidden_layers)}

    def pair_channel(self, host: str, port: int) -> None:
        """Join a verify worker's channel (blocks until it joins too) and answer it on a thread of
        its own; earlier links keep working (one draft worker may serve several verify workers)."""
        channel = open_channel(self.config.transport, host, port, 1)
        link = self._next_link
        self._next_link += 1
        thread = threading.Thread(target=self._serve, args=(channel, link), name=f"dspark-draft-{link}",
                                  daemon=True)
        self.links[link] = (channel, thread)
        self.error = None
        if not self.links.keys() - {link}:  # the first link: the constructor's team goes (see omp_teams)
            omp_teams.release()
        thread.start()

    def _serve(self, channel: PairChannel, link: int) -> None:
        try:
            serve_channel(channel, self.service, link)
        except Exception as exc:  # noqa: BLE001 - surfaced through stats() and is_alive()
            log.warning("draft link %d broke (%r): its verify partner's requests are forgotten here", link, exc)
            if not set(self.links) - {link}:  # no other link works: this worker is broken until re-paired
                self.error = repr(exc)
        finally:
            # that verify partner is gone (or closed the link), and with it every request it sent here
            self.links.pop(link, None)
            self.service.reset(link)

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """The Ray-transport path: one message in, its reply out."""
        if message.get("kind") == "ping":
            return {"kind": "pong", "seq": message.get("seq"), "payload": message.get("payload")}
        return self.service.handle(message)

    def pid(self) -> int:
        return os.getpid()

    @property
    def num_links(self) -> int:
        return len(self.links)

    def is_alive(self) -> bool:
        return self.error is None or bool(self.links)

    def stats(self) -> dict[str, Any]:
        spans = self.service.timeline()[-512:]
        busy = sum(s["end_s"] - s["start_s"] for s in spans)
        return {"worker_id": self.worker_id, "num_messages": self.service.num_messages,
                "num_requests": self.service.num_requests, "timeline": spans, "error": self.error,
                "num_links": self.num_links,
                "draft_ms_mean": 1e3 * busy / len(spans) if spans else 0.0}


# threaded: stats() answers while pair_channel waits for the peer or the Ray-transport handle() runs
DraftWorkerActor = ray.remote(max_concurrency=4)(DraftWorker)
