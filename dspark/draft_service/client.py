"""`RemoteDrafter`: the verify worker's handle on its paired draft worker, shaped like a drafter.

It implements the `FeatureDrafter` protocol (so the single-process `Engine` runs unchanged on it) plus
`submit`/`collect`, which split a draft round in two so that a pipelined engine can verify one
micro-batch while the draft worker drafts the other. Between messages it buffers what the draft side
has not seen yet: new tokens per request, target features from `observe`, released request ids.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dspark.actors.transport import Channel
from dspark.models.drafter import DraftOutput, DraftRequest


@dataclass
class TransportSpan:
    """Verify-side stamps of one draft round trip (wall-clock seconds; durations in ms)."""

    seq: int
    num_requests: int
    send_s: float
    send_ms: float  # packing + posting the sends
    collect_start_s: float = 0.0
    collect_end_s: float = 0.0
    draft_received_s: float = 0.0  # when the draft worker had the whole message
    draft_start_s: float = 0.0
    draft_end_s: float = 0.0

    @property
    def transport_ms(self) -> float:
        """Time spent moving bytes both ways, excluding drafting and the wait for a busy peer."""
        there = max(0.0, self.draft_received_s - self.send_s) * 1e3
        back = max(0.0, self.collect_end_s - max(self.draft_end_s, self.collect_start_s)) * 1e3
        return self.send_ms + there + back

    @property
    def exposed_ms(self) -> float:
        """How long the verify loop waited in `collect` (drafting not hidden behind verification)."""
        return (self.collect_end_s - self.collect_start_s) * 1e3


@dataclass
class _Buffered:
    num_sent_tokens: int = 0
    features: list[torch.Tensor] = field(default_factory=list)


class RemoteDrafter:
    """A drafter living in another process, reached through a `Channel`."""

    name = "remote"

    def __init__(self, channel: Channel, hidden_layers: tuple[int, ...], name: str = "remote",
                 max_num_spans: int = 4096) -> None:
        self.channel = channel
        self.hidden_layers = tuple(hidden_layers)
        self.name = name
        self._state: dict[str, _Buffered] = {}
        self._released: list[str] = []
        self._in_flight: deque[tuple[int, list[str], TransportSpan]] = deque()
        self._seq = 0
        self.spans: deque[TransportSpan] = deque(maxlen=max_num_spans)

    # ---- FeatureDrafter -------------------------------------------------------------------------
    def observe(self, request_id: str, features: torch.Tensor) -> None:
        if features.shape[0]:
            self._state.setdefault(request_id, _Buffered()).features.append(features)

    def release(self, request_id: str) -> None:
        if self._state.pop(request_id, None) is not None:
            self._released.append(request_id)

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        self.submit(requests, max_num_tokens)
        return self.collect()

    # ---- split round ------------------------------------------------------------------------------
    def submit(self, requests: list[DraftRequest], max_num_tokens: int) -> None:
        """Send one draft round; its reply is read by the matching `collect` (FIFO)."""
        t0 = time.perf_counter()
        entries, feats = [], []
        for req in requests:
            st = self._state.setdefault(req.request_id, _Buffered())
            new_tokens = req.token_ids[st.num_sent_tokens:]
            st.num_sent_tokens = len(req.token_ids)
            n = sum(f.shape[0] for f in st.features)
            feats += st.features
            st.features = []
            entries.append({"id": req.request_id, "new_tokens": new_tokens, "temperature": req.temperature,
                            "num_features": n})
        message: dict[str, Any] = {
            "kind": "draft", "seq": self._seq, "max_num_tokens": max_num_tokens, "requests": entries,
            "features": torch.cat(feats) if feats else None, "released": self._released}
        self._released = []
        send_s = time.time()
        self.channel.send(message)
        span = TransportSpan(self._seq, len(requests), send_s, (time.perf_counter() - t0) * 1e3)
        self._in_flight.append((self._seq, [r.request_id for r in requests], span))
        self._seq += 1

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def collect(self) -> DraftOutput:
        """The reply to the oldest `submit`, aligned with the requests it was sent for."""
        seq, _, span = self._in_flight.popleft()
        span.collect_start_s = time.time()
        reply = self.channel.recv()
        span.collect_end_s = time.time()
        if reply["seq"] != seq:
            raise RuntimeError(f"draft reply {reply['seq']} arrived while waiting for {seq}")
        span.draft_received_s, span.draft_start_s, span.draft_end_s = (
            reply["received_s"], reply["start_s"], reply["end_s"])
        self.spans.append(span)
        return DraftOutput(tokens=reply["tokens"], probs=reply["probs"], confidences=reply["confidences"])

    def in_flight_ids(self) -> list[str]:
        """Request ids of the oldest round in flight (what the next `collect` answers for)."""
        return list(self._in_flight[0][1]) if self._in_flight else []
