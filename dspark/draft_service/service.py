"""The draft side of a verify/draft pair, without Ray: per-request token history and draft context.

A verify worker sends one `draft` message per micro-batch step: for each request only what is NEW since
its last message (tokens appended to its output, target features of the tokens that entered the target's
KV cache), the ids of requests that left, and γ. The service updates its per-request state, drafts, and
answers with the draft tokens, the distributions they were drawn from, confidences, and wall-clock stamps
so the benchmark can draw both workers on one timeline. An `observe` message has the same shape with
γ = 0 and gets no reply: the verify side ships context early (while it is not drafting) so that the next
draft round carries only what is new since.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dspark.models.drafters.base import Drafter, DraftRequest, declines_features, features_optional

log = logging.getLogger(__name__)


@dataclass
class DraftSpan:
    """One handled message, for the timeline (wall-clock seconds)."""

    seq: int
    num_requests: int
    received_s: float
    start_s: float
    end_s: float


class DraftService:
    """Keeps each request's token history and feeds the drafter; thread-safe."""

    def __init__(self, drafter: Drafter | None, max_num_spans: int = 4096,
                 on_span: Callable[[DraftSpan, int], None] | None = None) -> None:
        """`on_span(span, num_contexts)`: called after each message (metrics)."""
        self.drafter = drafter
        self.on_span = on_span
        self.hidden_layers: tuple[int, ...] = tuple(getattr(drafter, "hidden_layers", ()))
        self._tokens: dict[str, list[int]] = {}
        self._owner: dict[str, int] = {}  # request -> the link (verify partner) it came on
        self._unusable: set[str] = set()  # requests the drafter failed on: they get empty drafts
        self._lock = threading.Lock()
        self.spans: deque[DraftSpan] = deque(maxlen=max_num_spans)
        self.num_messages = 0

    def handle(self, message: dict[str, Any], posted_s: float = 0.0, owner: int = 0) -> dict[str, Any]:
        """Apply a `draft` message (see module doc) and return the reply. `posted_s`: when this side
        started waiting for the message (so the verify side can tell transfer from a busy peer); `owner`:
        which verify partner sent it (one draft worker may serve several)."""
        received = time.time()
        with self._lock:
            start = time.time()
            self._apply_verdicts(message.get("verdicts") or [])
            for rid in message.get("released", []):
                self._forget(rid)
            if features_optional(self.drafter):
                for rid in message.get("forgone", []):
                    self.drafter.forgo_features(rid)  # before this message's features: none is observed for it
            for req in message["requests"]:
                self._owner.setdefault(req["id"], owner)
            reply = self._draft(message)
            end = time.time()
            self.num_messages += 1
        span = DraftSpan(message["seq"], len(message["requests"]), received, start, end)
        self.spans.append(span)
        if self.on_span is not None:
            self.on_span(span, len(self._tokens))
        return {**reply, "seq": message["seq"], "posted_s": posted_s, "received_s": received, "start_s": start,
                "end_s": end}

    def _draft(self, message: dict[str, Any]) -> dict[str, Any]:
        requests = message["requests"]
        features: torch.Tensor | None = message.get("features")
        offset = 0
        batch = []
        declined = []  # the requests whose features the drafter no longer wants: the verify side forgoes them
        for req in requests:
            history = self._tokens.setdefault(req["id"], [])
            history.extend(req["new_tokens"])
            n = req["num_features"]
            if declines_features(self.drafter, req["id"]):  # asked once, before its features: none is observed
                declined.append(req["id"])
            elif n and features is not None and self.hidden_layers:
                self.drafter.observe(req["id"], features[offset:offset + n])  # type: ignore[union-attr]
            offset += n
            # the history itself, as the inline engine hands a request's own list: drafters read it and keep no
            # reference, and it grows only with the next message (a copy cost ~1.5 µs a request a round)
            batch.append(DraftRequest(req["id"], history, req["temperature"], req.get("tenant", "")))
        if self.drafter is None or not batch or message["max_num_tokens"] == 0:
            return {"tokens": [[] for _ in batch], "probs": None, "confidences": None}
        usable = [r for r in batch if r.request_id not in self._unusable]
        try:
            out = self.drafter.propose(usable, message["max_num_tokens"])
        except Exception:  # noqa: BLE001 - one request's context must not cost the link: find it, skip it
            log.exception("draft round failed; drafting its requests one by one")
            usable = [r for r in usable if self._can_draft(r, message["max_num_tokens"])]
            out = self.drafter.propose(usable, message["max_num_tokens"])
        if len(usable) == len(batch):
            return {"tokens": out.tokens, "probs": out.probs, "confidences": out.confidences,
                    "sources": out.sources, "num_proposals": out.num_proposals, "declined": declined}
        by_id = {r.request_id: i for i, r in enumerate(usable)}  # requests without a draft get none (ℓ = 0)
        return {"tokens": [out.tokens[by_id[r.request_id]] if r.request_id in by_id else [] for r in batch],
                "probs": None, "confidences": None, "declined": declined}

    def _apply_verdicts(self, verdicts: list[tuple[str, int, int]]) -> None:
        """The verify side's verdicts on earlier rounds, for drafters that learn from them (suffix, hybrid)."""
        feedback = getattr(self.drafter, "feedback", None)
        if feedback is None or not verdicts:
            return
        ids, verified, accepted = zip(*verdicts)
        feedback(list(ids), list(verified), list(accepted))

    def _can_draft(self, req: DraftRequest, max_num_tokens: int) -> bool:
        try:
            self.drafter.propose([req], max_num_tokens)  # type: ignore[union-attr]
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("request %s cannot be drafted (%r): target-only from now on", req.request_id, exc)
            self._unusable.add(req.request_id)
            return False

    def _forget(self, rid: str) -> None:
        self._tokens.pop(rid, None)
        self._owner.pop(rid, None)
        self._unusable.discard(rid)
        if self.drafter is not None:
            self.drafter.release(rid)

    def reset(self, owner: int | None = None) -> None:
        """Forget the contexts of the requests of one verify partner (all: None); that partner is gone, so
        its requests never come back here."""
        with self._lock:
            for rid in [r for r in list(self._tokens) if owner is None or self._owner.get(r, 0) == owner]:
                self._forget(rid)

    @property
    def num_requests(self) -> int:
        return len(self._tokens)

    def timeline(self) -> list[dict[str, Any]]:
        return [vars(s) for s in list(self.spans)]


def serve_channel(channel: Any, service: DraftService, owner: int = 0) -> None:
    """Answer messages on `channel` until a `close` message: `draft` -> reply, `ping` -> echo."""
    while True:
        posted_s = time.time()
        message = channel.recv()
        kind = message.get("kind")
        if kind == "close":
            return
        if kind == "ping":
            channel.send({"kind": "pong", "seq": message.get("seq"), "payload": message.get("payload")})
            continue
        reply = service.handle(message, posted_s, owner)
        if kind != "observe":
            channel.send(reply)
