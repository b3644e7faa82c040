"""`RemoteDrafter`: the verify worker's handle on its paired draft worker, shaped like a drafter.

It implements the `FeatureDrafter` protocol (so the single-process `Engine` runs unchanged on it) plus
`submit`/`collect`, which split a draft round in two so that a pipelined engine can verify one
micro-batch while the draft worker drafts the other. Between messages it buffers what the draft side
has not seen yet: new tokens per request, target features from `observe`, released request ids. While
the engine is not drafting, `push` ships that backlog one way (over an ordered channel), so a round
after many undrafted steps does not carry all their features on its critical path.

A dead or broken draft worker (a failed send or receive: gloo reports a killed peer at once) costs
speed, never requests: the drafter marks itself broken, drops its buffers and from then on proposes
nothing, so the engine takes plain target steps — lossless by construction — until it is re-paired.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dspark.actors.transport import Channel
from dspark.models.drafters.base import FEATURES_OPTIONAL_DRAFTERS, DraftOutput, DraftRequest

log = logging.getLogger(__name__)

KEEPALIVE_S = 20.0  # well inside the pair's receive timeout (GlooChannel's 120 s)


@dataclass
class TransportSpan:
    """Verify-side stamps of one draft round trip (wall-clock seconds; durations in ms)."""

    seq: int
    num_requests: int
    send_s: float
    send_ms: float  # packing + posting the sends
    collect_start_s: float = 0.0
    collect_end_s: float = 0.0
    draft_posted_s: float = 0.0  # when the draft worker began waiting for it (0: unknown, e.g. Ray calls)
    draft_received_s: float = 0.0  # when the draft worker had the whole message
    draft_start_s: float = 0.0
    draft_end_s: float = 0.0

    @property
    def transport_ms(self) -> float:
        """Time spent moving bytes both ways, excluding drafting and the wait for a busy peer."""
        there = max(0.0, self.draft_received_s - max(self.send_s, self.draft_posted_s)) * 1e3
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
                 max_num_spans: int = 4096, keepalive_s: float = KEEPALIVE_S,
                 on_block: Callable[[], None] | None = None) -> None:
        """`on_block`: run when a round's reply may not have arrived yet and `collect` is about to wait for it."""
        self.channel = channel
        self.on_block = on_block
        self.num_blocked_rounds = 0  # rounds collect may have waited for (over gloo: every one, it cannot tell)
        self.keepalive_s = keepalive_s
        self.hidden_layers = tuple(hidden_layers)
        self.name = name
        self.features_optional = name in FEATURES_OPTIONAL_DRAFTERS  # the far side can draft without features
        self._state: dict[str, _Buffered] = {}
        self._released: list[str] = []
        self._forgone: set[str] = set()  # requests whose features are forgone (their features are not sent)
        self._newly_forgone: list[str] = []  # not yet told to the far side
        self._declined: set[str] = set()  # requests whose features the far side's drafter no longer wants
        self._verdicts: list[tuple[str, int, int]] = []  # (request, verified, accepted) not yet sent
        self._in_flight: deque[tuple[int, list[str], TransportSpan]] = deque()
        self._seq = 0
        self.spans: deque[TransportSpan] = deque(maxlen=max_num_spans)
        self.push_ms: deque[float] = deque(maxlen=max_num_spans)  # local cost of each one-way push
        self._last_send_s = time.monotonic()
        self.total_transport_ms = 0.0  # every round's transport_ms and every push, since the start
        self.error: str | None = None  # why the channel broke; None while it works
        self._void_below = 0  # rounds with a lower seq were sent to a peer that is gone: no reply comes

    @classmethod
    def unpaired(cls, hidden_layers: tuple[int, ...], name: str = "remote") -> RemoteDrafter:
        """A drafter with no draft worker yet: target-only (empty drafts) until `reconnect`."""
        drafter = cls(None, hidden_layers, name=name)  # type: ignore[arg-type]
        drafter.error = "not paired yet"
        return drafter

    @property
    def is_broken(self) -> bool:
        return self.error is not None

    def _fail(self, exc: BaseException) -> None:
        """The peer is gone (or the channel broke): stop using it; the engine goes on target-only."""
        if self.error is None:
            log.warning("draft channel broke (%r): serving target-only until re-paired", exc)
            self.error = repr(exc)
        self._state.clear()
        self._released.clear()
        self._newly_forgone.clear()  # _forgone stays: the engine does not feed those requests again
        self._verdicts = []
        try:
            self.channel.close()
        except Exception:  # noqa: BLE001 - already broken
            pass

    def reconnect(self, channel: Channel) -> None:
        """Continue on a new channel (a replaced draft worker), on the engine thread between steps. The new
        peer starts without context: each request's tokens go again in full, and its features from now on
        (a request that began before drafts from that shorter context; verification keeps it lossless)."""
        with contextlib.suppress(Exception):
            self.channel.close()
        self.channel = channel
        self.error = None
        self._state.clear()
        self._released.clear()
        self._newly_forgone = list(self._forgone)  # the new peer is told too
        self._verdicts = []
        self._void_below = self._seq
        self._last_send_s = time.monotonic()

    # ---- FeatureDrafter -------------------------------------------------------------------------
    def observe(self, request_id: str, features: torch.Tensor) -> None:
        if features.shape[0] and not self.is_broken and request_id not in self._forgone:
            self._state.setdefault(request_id, _Buffered()).features.append(features)

    def forgo_features(self, request_id: str) -> None:
        """`FeaturesOptional` (where the far side's drafter is): its buffered features are dropped, and the far
        side is told with the next message, before that message's features are observed."""
        if self.features_optional and request_id not in self._forgone:
            self._forgone.add(request_id)
            self._newly_forgone.append(request_id)
            st = self._state.get(request_id)
            if st is not None:
                st.features = []

    def wants_features(self, request_id: str) -> bool:
        """`FeaturesOptional`: what the far side's drafter said in its latest reply for this request."""
        return request_id not in self._declined

    def release(self, request_id: str) -> None:
        self._forgone.discard(request_id)
        self._declined.discard(request_id)
        if self._state.pop(request_id, None) is not None:
            self._released.append(request_id)

    def feedback(self, request_ids: list[str], num_verified: list[int], num_accepted: list[int]) -> None:
        """The engine's verdict on a round (tokens verified and accepted per request): it rides on the next
        message, so a multi-source drafter on the far side learns its sources' acceptance (`feedback`)."""
        self._verdicts += [(rid, v, a) for rid, v, a in zip(request_ids, num_verified, num_accepted) if v > 0]

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        self.submit(requests, max_num_tokens)
        return self.collect()

    # ---- split round ------------------------------------------------------------------------------
    def submit(self, requests: list[DraftRequest], max_num_tokens: int) -> None:
        """Send one draft round; its reply is read by the matching `collect` (FIFO)."""
        t0 = time.perf_counter()
        send_s = time.time()
        if not self.is_broken:
            try:
                self.channel.send(self._message("draft", requests, max_num_tokens))
                self.channel.expect()  # its reply goes at once, not after a notice that this side is ready
            except Exception as exc:  # noqa: BLE001 - a dead peer: its round comes back empty
                self._fail(exc)
        span = TransportSpan(self._seq, len(requests), send_s, (time.perf_counter() - t0) * 1e3)
        self._in_flight.append((self._seq, [r.request_id for r in requests], span))
        self._seq += 1

    @property
    def can_push(self) -> bool:
        return bool(getattr(self.channel, "ordered", False))

    def num_buffered_rows(self, requests: list[DraftRequest]) -> int:
        """Feature rows of these requests that the draft side has not received yet."""
        return sum(f.shape[0] for r in requests if (st := self._state.get(r.request_id)) for f in st.features)

    def push(self, requests: list[DraftRequest]) -> None:
        """Ship these requests' new tokens and features (and released ids) now, one way: no draft, no
        reply. Only over an ordered channel, where it cannot overtake or be overtaken by a round."""
        if not self.can_push:
            raise RuntimeError(f"{type(self.channel).__name__} does not keep message order: no one-way push")
        if self.is_broken:
            return
        t0 = time.perf_counter()
        try:
            self.channel.send(self._message("observe", requests, 0))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return
        self.push_ms.append((time.perf_counter() - t0) * 1e3)
        self.total_transport_ms += self.push_ms[-1]
        self._seq += 1

    def keepalive(self, max_silence_s: float | None = None, flush_released: bool = False) -> bool:
        """An empty one-way push if nothing was sent for `max_silence_s` (default `keepalive_s`): the draft
        worker blocks in a receive that times out (the pair's gloo timeout) when its verify worker is
        idle, or is not drafting, for longer. With `flush_released` (an idle engine), also when finished
        requests wait to be announced, so their draft contexts are freed now. True when one was sent."""
        silence = self.keepalive_s if max_silence_s is None else max_silence_s
        if self.is_broken or not self.can_push:
            return False
        if not (flush_released and self._released) and time.monotonic() - self._last_send_s < silence:
            return False
        self.push([])
        return True

    def _message(self, kind: str, requests: list[DraftRequest], max_num_tokens: int) -> dict[str, Any]:
        """What the draft side has not seen of these requests (the buffers are emptied)."""
        entries, feats = [], []
        for req in requests:
            st = self._state.setdefault(req.request_id, _Buffered())
            new_tokens = req.token_ids[st.num_sent_tokens:]
            st.num_sent_tokens = len(req.token_ids)
            n = sum(f.shape[0] for f in st.features)
            feats += st.features
            st.features = []
            entries.append({"id": req.request_id, "new_tokens": new_tokens, "temperature": req.temperature,
                            "num_features": n, "tenant": req.tenant})
        message: dict[str, Any] = {
            "kind": kind, "seq": self._seq, "max_num_tokens": max_num_tokens, "requests": entries,
            "features": torch.cat(feats) if feats else None, "released": self._released,
            "forgone": self._newly_forgone, "verdicts": self._verdicts}
        self._verdicts = []
        self._released = []
        self._newly_forgone = []
        self._last_send_s = time.monotonic()
        return message

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def collect(self) -> DraftOutput:
        """The reply to the oldest `submit`, aligned with the requests it was sent for."""
        seq, ids, span = self._in_flight.popleft()
        if self.is_broken or seq < self._void_below:
            return DraftOutput(tokens=[[] for _ in ids])  # nothing to verify: plain target steps
        span.collect_start_s = time.time()
        try:
            reply = self.channel.recv(on_block=self._blocked)
        except Exception as exc:  # noqa: BLE001 - a dead peer
            self._fail(exc)
            return DraftOutput(tokens=[[] for _ in ids])
        span.collect_end_s = time.time()
        if reply["seq"] != seq:
            raise RuntimeError(f"draft reply {reply['seq']} arrived while waiting for {seq}")
        span.draft_posted_s, span.draft_received_s, span.draft_start_s, span.draft_end_s = (
            reply.get("posted_s", 0.0), reply["received_s"], reply["start_s"], reply["end_s"])
        self.spans.append(span)
        self.total_transport_ms += span.transport_ms
        self._declined.update(rid for rid in reply.get("declined") or () if rid in ids)
        return DraftOutput(tokens=reply["tokens"], probs=reply["probs"], confidences=reply["confidences"],
                           sources=reply.get("sources"), num_proposals=reply.get("num_proposals"))

    def _blocked(self) -> None:
        self.num_blocked_rounds += 1
        if self.on_block is not None:
            self.on_block()

    def in_flight_ids(self) -> list[str]:
        """Request ids of the oldest round in flight (what the next `collect` answers for)."""
        return list(self._in_flight[0][1]) if self._in_flight else []
