"""Whether a step should draft at all: speculation pays only if its extra tokens outrun its draft cost.

The prefix scheduler sees the draft after it was made, so its Θ = τ·SPS(B) cannot include the cost of
drafting: under heavy load it verifies ℓ ≈ 0 and the step still paid for a draft round. The gate closes
that gap with measured times. Per batch size B it compares the rate of drafted steps

    spec(B) = Σ w·(B + accepted) / Σ w·(R_draft + O)

(a decayed sum over the recent drafted steps: R_draft is a drafted round's measured time, drafting on
the critical path included — a drafter overlapped with verification costs what the round waited for
it) with the rate of plain steps, B / (R_plain(B) + O), where R_plain(B) is the measured time of the
rounds that did not draft at B (before any was seen, estimated from the drafted rounds' own verify
forwards, see `DraftGate.record`) and O the measured time a step spends outside its round (admission,
streaming replies, the serving loop), which both alternatives pay. A ratio of sums rather than a mean
of per-step ratios, so one lucky probe does not reopen a gate that many probes kept shut.
While g(B) = spec(B) / plain(B) stays at or below 1 the gate skips drafting at that batch size and
probes again every few steps, backing off while probes keep losing. Symmetrically, while g(B) > 1 the
gate skips drafting for one step every few steps (a plain probe), backing off while drafting keeps
winning: R_plain(B) is then measured, not estimated. An estimate leans on the profile's shape, and a
profile measured on verify-shaped chunks (8 tokens a request) prices one more token for each of 32
requests lower than a real step does, which kept a losing gate open at high load.

Robust to one slow round: the sums run over the last `window` drafted rounds at B, leaving out any round
slower than `outlier` × their low median, and a plain round counts at most `outlier` × the current R_plain
(a genuine slow-down still moves it, by steps). Without that, an engine's first rounds (lazy kernel set-up,
cold caches: 5-10x a warm round on a 2-core AMD EPYC) shut the gate for the rest of a run, since probes get
rarer while they lose. A batch size not seen yet starts where the nearest smaller measured size stands when
that one is shut (speculation pays less as the batch grows: the paper's Fig. 8), so under changing load
every new size does not pay a round of drafting to learn what its neighbour already knew.

Lossless: whether a step drafts depends only on past steps (batch size, past acceptance, past timings),
never on the tokens being verified, and a skipped step is exactly a target-only decode step.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from dspark.spec.sps import SPSTable


@dataclass
class _Round:
    tokens: int  # B + accepted
    round_ms: float  # R_draft
    bound_ms: float  # R_draft less its drafting and scheduling: at most what the round would have taken plain


@dataclass
class _SizeState:
    probe_interval: int  # steps between probes while g(B) <= 1
    rounds: deque[_Round]  # the last `window` drafted rounds, newest last
    inherited: bool = False  # shut on a smaller size's word, not yet probed itself
    gain: float = 1.0  # g(B) at the last drafted round
    plain_ms: float | None = None  # smoothed R_plain(B), measured on plain rounds
    plain_estimate_ms: float | None = None  # R_plain(B) estimated from drafted rounds' verify forwards
    skipped: int = 0  # steps skipped since the last drafted one
    plain_interval: int = 16  # drafted steps between plain probes while g(B) > 1
    since_plain: int = 0  # drafted steps since the last plain probe
    plain_probed: bool = False  # a plain probe ran; the next drafted round says whether to back off


class DraftGate:
    """Per batch size, draft while measured speculation beats target-only decoding."""

    def __init__(self, probe_every: int = 8, max_probe_every: int = 64, memory: float = 0.9,
                 smoothing: float = 0.8, window: int = 32, outlier: float = 3.0,
                 plain_probe_every: int = 16, max_plain_probe_every: int = 256, inherit_min_rounds: int = 4) -> None:
        if not 1 <= probe_every <= max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {probe_every}, {max_probe_every}")
        if not 1 <= plain_probe_every <= max_plain_probe_every:
            raise ValueError(f"need 1 <= plain_probe_every <= max_plain_probe_every, got {plain_probe_every}, "
                             f"{max_plain_probe_every}")
        if not 0.0 <= memory < 1.0:
            raise ValueError(f"memory must be in [0, 1), got {memory}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if outlier <= 1.0:
            raise ValueError(f"outlier must be > 1, got {outlier}")
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.memory = memory  # decay of the drafted rounds' sums, per drafted round
        self.smoothing = smoothing  # of the plain round times
        self.window = window  # drafted rounds per batch size that g(B) is computed over
        self.outlier = outlier  # a round this many times its peers' low median is left out
        self.plain_probe_every = plain_probe_every  # drafted steps between an open gate's plain probes
        self.max_plain_probe_every = max_plain_probe_every  # their back-off cap
        self.inherit_min_rounds = inherit_min_rounds  # drafted rounds a size needs before larger ones inherit
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
        if state is None or not state.rounds:
            state = self._inherit(batch_size) or state
        unknown = state is None or not (state.rounds or state.inherited)
        if unknown or state.skipped + 1 >= state.probe_interval:
            self.num_drafted += 1
            return True
        if state.gain > 1.0:
            if state.since_plain + 1 < state.plain_interval:
                state.since_plain += 1
                self.num_drafted += 1
                return True
            state.since_plain, state.plain_probed = 0, True  # a plain probe: measure R_plain(B)
        state.skipped += 1
        self.num_skipped += 1
        return False

    def is_shut(self, batch_size: int) -> bool:
        """Whether drafting is measured not to pay at `batch_size`: by its own drafted rounds or, before it has
        any, by the nearest smaller size's as `should_draft` would inherit it. A query: changes nothing."""
        state = self._sizes.get(batch_size)
        if state is not None and (state.rounds or state.inherited):
            return state.gain <= 1.0
        return self._shut_neighbour(batch_size) is not None

    def _inherit(self, batch_size: int) -> _SizeState | None:
        """A new size starts shut where the nearest smaller drafted size is shut (its gain and back-off), once
        that size drafted `inherit_min_rounds` times. One unlucky round is no evidence: a batch-1 round that
        accepted nothing once shut every larger size of a drain that had not drafted yet."""
        near = self._shut_neighbour(batch_size)
        if near is None:
            return None
        state = self._state(batch_size)
        state.gain, state.probe_interval, state.inherited = near.gain, near.probe_interval, True
        return state

    def _shut_neighbour(self, batch_size: int) -> _SizeState | None:
        """The nearest smaller drafted size, if it is shut on at least `inherit_min_rounds` drafted rounds."""
        smaller = [b for b, st in self._sizes.items() if b < batch_size and st.rounds]
        if not smaller:
            return None
        near = self._sizes[max(smaller)]
        return near if near.gain <= 1.0 and len(near.rounds) >= self.inherit_min_rounds else None

    def _state(self, batch_size: int) -> _SizeState:
        if batch_size not in self._sizes:
            self._sizes[batch_size] = _SizeState(self.probe_every, deque(maxlen=self.window),
                                                 plain_interval=self.plain_probe_every)
        return self._sizes[batch_size]

    def plain_ms(self, batch_size: int, sps: SPSTable) -> float:
        """R_plain(B): measured on plain rounds at B; else estimated from the drafted rounds' verify
        forwards at B (below); else the profile's T(B)."""
        state = self._sizes.get(batch_size)
        if state is not None and state.plain_ms is not None:
            return state.plain_ms
        if state is not None and state.plain_estimate_ms is not None:
            return state.plain_estimate_ms
        return sps.step_time_ms_at(batch_size)

    def record_plain(self, batch_size: int, round_ms: float) -> None:
        """Fold in a round that verified no draft (skipped, or nothing drafted)."""
        if batch_size < 1 or round_ms <= 0.0:
            return
        state = self._state(batch_size)
        if state.plain_ms is None:
            state.plain_ms = round_ms
        else:
            capped = min(round_ms, self.outlier * state.plain_ms)
            state.plain_ms = self.smoothing * state.plain_ms + (1.0 - self.smoothing) * capped

    def record(self, batch_size: int, num_verified: int, num_accepted: int, round_ms: float,
               verify_ms: float, sps: SPSTable, draft_ms: float = 0.0) -> float:
        """Fold in one drafted round: its measured time (drafting included), that of its verify
        forward of batch_size + num_verified tokens, and `draft_ms` of it spent drafting and scheduling.
        Returns this round's own g.

        Until a plain round at B is measured, R_plain(B) is estimated from this verify forward as
        verify_ms · T(B) / T(B + verified): exact when nothing was verified, and otherwise leaning on
        the profile only for the ratio of two nearby token counts, never for this machine's speed.

        g(B) is also bounded by the rounds themselves: without its drafting and scheduling, and with its
        verified drafts for free, a round would have been at least as fast as a plain one, so g(B) cannot
        exceed Σ(B + accepted) / Σ R_draft over B / Σ(R_draft − drafting) (O added to each). A measured R_plain
        reads the plain rounds of other moments, a few probes far apart: on a noisy shared host (a 2-core Zen 5
        EPYC over HTTP, session 61) one slow probe put R_plain(16) at 33 ms against the drafted rounds' 27, and
        the gate stayed open at 16 requests for rounds that verified nothing. The bound holds whatever the
        probes read: rounds that accept nothing shut the gate.
        """
        if batch_size < 1:
            return 1.0
        state = self._state(batch_size)
        if verify_ms > 0.0:
            est = verify_ms * sps.step_time_ms_at(batch_size) / sps.step_time_ms_at(batch_size + num_verified)
            a = self.smoothing if state.plain_estimate_ms is not None else 0.0
            state.plain_estimate_ms = a * (state.plain_estimate_ms or 0.0) + (1.0 - a) * est
        overhead = self.overhead_ms
        plain = batch_size / (self.plain_ms(batch_size, sps) + overhead)
        state.inherited = False
        state.rounds.append(_Round(batch_size + num_accepted, max(0.0, round_ms),
                                   max(0.0, round_ms - max(0.0, draft_ms))))
        limit = self.outlier * statistics.median_low(r.round_ms for r in state.rounds)
        tokens = round_ms_sum = bound_ms_sum = weight = 0.0
        w = 1.0
        for r in reversed(state.rounds):  # newest first, weights memory ** age
            if r.round_ms <= limit:
                tokens += w * r.tokens
                round_ms_sum += w * r.round_ms
                bound_ms_sum += w * r.bound_ms
                weight += w
            w *= self.memory
        if weight > 0.0:
            spec = tokens / (round_ms_sum + weight * overhead)
            bound = spec / (weight * batch_size / (bound_ms_sum + weight * overhead))
            state.gain = min(spec / plain, bound)
        else:
            state.gain = 1.0
        if state.plain_probed:  # the first drafted round after a plain probe: drafting still wins, probe rarer
            state.plain_interval = (min(self.max_plain_probe_every, 2 * state.plain_interval)
                                    if state.gain > 1.0 else self.plain_probe_every)
            state.plain_probed = False
        if state.gain > 1.0:
            state.probe_interval = self.probe_every
        elif state.skipped > 0:  # a probe that lost again: wait longer before the next one
            state.probe_interval = min(self.max_probe_every, 2 * state.probe_interval)
        state.skipped = 0
        return (batch_size + num_accepted) / (max(0.0, round_ms) + overhead) / plain

    def gains(self) -> dict[int, float]:
        """g(B) per batch size drafted at so far (for stats and plots)."""
        return {size: state.gain for size, state in sorted(self._sizes.items()) if state.rounds}

    def summary(self) -> dict[int, dict[str, float | int | None]]:
        """What g(B) rests on, per batch size seen: its drafted rounds (count, median time, mean tokens), R_plain
        measured and estimated, and the probe intervals; with O in `overhead_ms`. For stats: a gain that looks
        wrong is read from here."""
        out: dict[int, dict[str, float | int | None]] = {}
        for size, st in sorted(self._sizes.items()):
            rounds = list(st.rounds)
            out[size] = {
                "gain": st.gain if rounds else None, "num_rounds": len(rounds),
                "round_ms_median": statistics.median(r.round_ms for r in rounds) if rounds else None,
                "tokens_mean": sum(r.tokens for r in rounds) / len(rounds) if rounds else None,
                "plain_ms": st.plain_ms, "plain_estimate_ms": st.plain_estimate_ms,
                "probe_interval": st.probe_interval, "plain_interval": st.plain_interval,
            }
        return out
