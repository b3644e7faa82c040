"""Engine-side metrics: what each step of a verify replica (or an inline replica) did.

Called on the engine thread after every `step()` (the AsyncEngine `on_step` hook). It reads the step
records the engine keeps anyway (`Engine.stats`, the drafter's transport spans, the gate's counters), so
the step loop itself does no metric work.
"""

from __future__ import annotations

from typing import Any

from dspark.metrics.series import Metrics
from dspark.verify_service.request import StepStats


class EngineMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._num_steps_seen = 0
        self._last_span_seq: int | None = None
        self._gate_counts = (0, 0)
        self._gate_open: float | None = None

    def after_step(self, engine: Any) -> None:
        """After a step, or from the idle loop (then only the gauges are set again)."""
        m = self.metrics
        if not m.is_enabled:
            return
        new = min(engine.num_steps - self._num_steps_seen, len(engine.stats))
        self._num_steps_seen = engine.num_steps
        for s in engine.stats[-new:] if new > 0 else []:  # a slice: no copy of the whole window per step
            self._observe_step(s)
        m.set("vllm:num_requests_running", len(engine.running))
        m.set("vllm:num_requests_waiting", len(engine.waiting))
        capacity = getattr(engine.scheduler, "capacity", None)
        if isinstance(capacity, int):
            m.set("dspark_capacity_k", capacity)
        gate = engine.gate
        if gate is not None:
            drafted, skipped = gate.num_drafted, gate.num_skipped
            if (drafted, skipped) != self._gate_counts:
                self._gate_open = 1.0 if drafted > self._gate_counts[0] else 0.0
                self._gate_counts = (drafted, skipped)
            if self._gate_open is not None:  # set on idle calls too: Ray drops a gauge left unset
                m.set("dspark_draft_gate_open", self._gate_open)
        self._observe_transport(engine.drafter)

    def _observe_sources(self, s: StepStats) -> None:
        """Per draft source (multi-source drafters): proposals, chosen drafts, verified/accepted tokens. Summed over
        the step's requests first: one counter update per source and series, not one per request (each is a
        Ray metric call on the engine thread; ~150 a drafted step at batch 32 before)."""
        m = self.metrics
        for source, n in (s.num_proposals or {}).items():
            if n:
                m.inc("dspark_draft_source_proposals_total", n, source=source)
        if not s.sources:
            return
        chosen: dict[str, int] = {}
        verified: dict[str, int] = {}
        accepted_by: dict[str, int] = {}
        per_pos: dict[tuple[str, int], int] = {}
        for source, length, accepted in zip(s.sources, s.lengths, s.num_accepted):
            if not source:
                continue
            chosen[source] = chosen.get(source, 0) + 1
            verified[source] = verified.get(source, 0) + length
            accepted_by[source] = accepted_by.get(source, 0) + accepted
            for p in range(accepted):
                per_pos[source, p] = per_pos.get((source, p), 0) + 1
        for source, n in chosen.items():
            m.inc("dspark_draft_source_chosen_total", n, source=source)
            m.inc("dspark_draft_source_verified_tokens_total", verified[source], source=source)  # 0: no call
            m.inc("dspark_draft_source_accepted_tokens_total", accepted_by[source], source=source)
        for (source, p), n in per_pos.items():
            m.inc("dspark_draft_source_accepted_per_pos_total", n, source=source, position=str(p))

    def _observe_step(self, s: StepStats) -> None:
        m = self.metrics
        m.observe("dspark_step_tokens", s.num_tokens)
        m.observe("dspark_step_seconds", s.verify_ms / 1e3)
        num_drafts = num_draft_tokens = num_accepted = 0
        per_pos: dict[int, int] = {}
        predicted: dict[int, float] = {}
        observed: dict[int, int] = {}
        reached: dict[int, int] = {}
        for r, (length, accepted) in enumerate(zip(s.lengths, s.num_accepted)):
            if length == 0:
                continue
            m.observe("dspark_verification_length", length)
            num_drafts += 1
            num_draft_tokens += length
            num_accepted += accepted
            for p in range(accepted):
                per_pos[p] = per_pos.get(p, 0) + 1
            conf = s.confidences[r] if s.confidences and r < len(s.confidences) else None
            if conf:
                survival = 1.0
                for k in range(min(length, len(conf))):
                    survival *= conf[k]  # a_k = Π_{i ≤ k} c_i, the scheduler's prefix-survival estimate
                    predicted[k] = predicted.get(k, 0.0) + survival
                    observed[k] = observed.get(k, 0) + int(accepted > k)
                    reached[k] = reached.get(k, 0) + 1
        self._observe_sources(s)
        m.inc("vllm:spec_decode_num_drafts_total", num_drafts)
        m.inc("vllm:spec_decode_num_draft_tokens_total", num_draft_tokens)
        m.inc("vllm:spec_decode_num_accepted_tokens_total", num_accepted)
        for p, n in per_pos.items():
            m.inc("vllm:spec_decode_num_accepted_tokens_per_pos_total", n, position=str(p))
        for k, n in reached.items():
            m.inc("dspark_verified_positions_total", n, position=str(k))
            m.inc("dspark_predicted_survival_total", predicted[k], position=str(k))
            m.inc("dspark_observed_survival_total", observed[k], position=str(k))

    def _observe_transport(self, drafter: Any) -> None:
        spans = getattr(drafter, "spans", None)
        if not spans:
            return
        fresh = []  # newest first; the drafter appends on this (the engine's) thread, so no race
        for span in reversed(spans):
            if (self._last_span_seq is not None and span.seq <= self._last_span_seq) or len(fresh) == 64:
                break
            fresh.append(span)
        for span in fresh:
            self.metrics.observe("dspark_transport_seconds", span.transport_ms / 1e3)
            self.metrics.observe("dspark_draft_wait_seconds", span.exposed_ms / 1e3)
        if fresh:
            self._last_span_seq = fresh[0].seq
