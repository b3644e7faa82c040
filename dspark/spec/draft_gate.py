"""Whether a step should draft at all: speculation pays only if its extra tokens outrun its draft cost.

The prefix scheduler sees the draft after it was made, so its Θ = τ·SPS(B) cannot include the cost of
drafting: under heavy load it verifies ℓ ≈ 0 and the step still paid for a draft round. The gate closes
that gap. After every drafted step at batch size B it estimates the gain ratio

    g(B) = [(B + accepted) / (T(B + verified) + D + O)] / [B / (T(B) + O)]

from the tokens actually verified and accepted, the measured time D the step spent on drafting (on the
critical path only: a drafter overlapped with verification costs what the step waited for it), the SPS
profile's step time T, and the measured time O a step spends outside its draft-verify round (admission,
streaming replies, the serving loop), which both alternatives pay. While the smoothed g(B) stays at or
below 1 the gate skips drafting at that batch size and probes again every few steps, backing off while
probes keep losing.

Lossless: whether a step drafts depends only on past steps (batch size, past acceptance, past timings),
never on the tokens being verified, and a skipped step is exactly a target-only decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.spec.sps import SPSTable


@dataclass
class _SizeState:
    gain: float  # smoothed g(B)
    probe_interval: int  # steps between probes while g(B) <= 1
    skipped: int = 0  # steps skipped since the last drafted one


class DraftGate:
    """Per batch size, draft while measured speculation beats target-only decoding."""

    def __init__(self, probe_every: int = 8, max_probe_every: int = 64, smoothing: float = 0.5) -> None:
        if not 1 <= probe_every <= max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {probe_every}, {max_probe_every}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.smoothing = smoothing
        self._sizes: dict[int, _SizeState] = {}
        self.overhead_ms = 0.0  # O: smoothed time between rounds
        self.num_drafted = 0
        self.num_skipped = 0

    def note_overhead(self, gap_ms: float, smoothing: float = 0.9) -> None:
        """Fold in the time between the end of one round and the start of the next."""
        self.overhead_ms = smoothing * self.overhead_ms + (1.0 - smoothing) * max(0.0, gap_ms)

    def should_draft(self, batch_size: int) -> bool:
        """Decide for a step of `batch_size` requests; counts the step as skipped if it says no."""
        state = self._sizes.get(batch_size)
        if state is None or state.gain > 1.0 or state.skipped + 1 >= state.probe_interval:
            self.num_drafted += 1
            return True
        state.skipped += 1
        self.num_skipped += 1
        return False

    def record(self, batch_size: int, num_verified: int, num_accepted: int, draft_ms: float,
               sps: SPSTable) -> float:
        """Fold in one drafted step's outcome; returns this step's gain ratio g."""
        if batch_size < 1:
            return 1.0
        overhead = self.overhead_ms
        spec_ms = sps.step_time_ms_at(batch_size + num_verified) + max(0.0, draft_ms) + overhead
        spec = (batch_size + num_accepted) / spec_ms
        plain = batch_size / (sps.step_time_ms_at(batch_size) + overhead)
        gain = spec / plain
        state = self._sizes.get(batch_size)
        if state is None:
            state = self._sizes[batch_size] = _SizeState(gain, self.probe_every)
        else:
            state.gain = self.smoothing * state.gain + (1.0 - self.smoothing) * gain
        if state.gain > 1.0:
            state.probe_interval = self.probe_every
        elif state.skipped > 0:  # a probe that lost again: wait longer before the next one
            state.probe_interval = min(self.max_probe_every, 2 * state.probe_interval)
        state.skipped = 0
        return gain

    def gains(self) -> dict[int, float]:
        """Smoothed g(B) per batch size seen so far (for stats and plots)."""
        return {size: state.gain for size, state in sorted(self._sizes.items())}
