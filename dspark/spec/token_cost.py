"""The measured cost of verifying one more draft token, per batch size, for the prefix scheduler.

Algorithm 1 admits a draft token while Θ = τ·SPS(B) rises, so the slope of the step-time table past the
batch's own B tokens decides how much is verified: a token of survival a pays iff a > m·(E / T), with m
the extra milliseconds one verified token costs, E the tokens the step emits and T its time. The
profile's slope comes from verify-shaped chunks (8 tokens a request); a real round at batch 32 spreads the
same extra tokens over 32 requests, and its extra rows also pay the head, acceptance and the drafter's
feature taps. Measured (SmolLM2 bf16, 1 thread, AMX Xeon): ~1.5 ms per verified token against the
profile's 0.6, so the scheduler verified tokens of survival 0.35–0.8 that cost more than they returned.

`TokenCost` fits, per band of batch sizes, the verify forward's time in excess of the profile's plain time
T(B) against the number of draft tokens verified: excess ≈ c + m·ℓ, a least-squares line over decayed sums
of recent rounds (plain rounds, ℓ = 0, anchor it; the draft gate probes them). `table` then hands the
scheduler T'(n) = T(B) + m·(n − B): the profile's plain time, the measured slope. Until a band has rounds
enough and a spread of ℓ to fit on, or if the fit is off the profile's slope by more than `clamp`, the
profile's own slope (bounded by `clamp`) stands.

Lossless: the table depends on past rounds' timings and sizes only, never on the tokens being verified.

Off by default (`measured_token_cost`): its first version lost where it was meant to win. `dspark bench decode
--drafters hybrid-tokencost,hybrid --batch-sizes 1,8,32 --waves 2 --num-threads 1 --dtype bf16` (one run,
`docs/results/suffix/s34/bench_decode_token_cost_ab.json`; the arms were then called `hybrid` and
`hybrid-profilecost`): the fit found 1.05 ms per token at batch 32 and 0.71 at batch 8, Algorithm 1 verified 0.39
tokens a request at batch 32 instead of 1.06, and the steady state fell from 1.05× to 0.99× target-only (batch 8:
1.22× to 1.18×; batch 1: 1.86× to 1.94×, up). So the tokens of survival ~0.3–0.5 that the profile's cheaper slope
lets through did pay. Their survival is over-confident at batch 32, not under (`scripts/survival_vs_acceptance.py`).
The cause was the table's plain time: `scripts/token_cost_within_round.py` timed the forward of 32 one-token
requests at 77 ms against the profile's 60 for 32 tokens in chunks of 8 (32 contexts read, not 4), and one more
token at 0.81 ms within a round (0.81–0.90 in the profile's shape). Algorithm 1 weighs a token by slope ÷ plain
time: the profile's 0.6 / 55 and the real 0.81 / 77 are both ~1.1 % a token, while the measured slope on the
profile's plain time made it 1.9 %. The table now takes the plain time from the fit's intercept too. Second A/B
(`bench_decode_token_cost_ab2.json`, same command, arms `hybrid-tokencost` and `hybrid`): batch 1 1.91× vs 1.86×,
batch 8 steady 1.28× vs 1.25×, batch 32 steady 1.03× vs 1.04×; within the run-to-run spread, so it stays off.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.spec.sps import SPSTable


@dataclass
class _Fit:
    """Decayed sums of (ℓ, excess ms) over a band's recent rounds."""

    w: float = 0.0
    x: float = 0.0
    xx: float = 0.0
    y: float = 0.0
    xy: float = 0.0
    rounds: int = 0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w, self.x, self.xx = decay * self.w + 1.0, decay * self.x + x, decay * self.xx + x * x
        self.y, self.xy = decay * self.y + y, decay * self.xy + x * y
        self.rounds += 1

    def line(self, min_rounds: int, min_spread: float) -> tuple[float, float] | None:
        """(c, m) of the weighted line, or None while the rounds are too few or their ℓ too alike to fit on."""
        if self.rounds < min_rounds or self.w <= 0:
            return None
        mean_x, mean_y = self.x / self.w, self.y / self.w
        var_x = self.xx / self.w - mean_x ** 2
        if var_x < min_spread:
            return None
        m = (self.xy / self.w - mean_x * mean_y) / var_x
        return mean_y - m * mean_x, m


def band_of(batch_size: int) -> int:
    """Bands 1, 2, 3-4, 5-8, 9-16, 17-32, ...: the per-token cost changes slowly with the batch."""
    return max(0, (batch_size - 1).bit_length())


class TokenCost:
    """Per band of batch sizes, the measured ms of one more verified draft token (see the module docstring)."""

    def __init__(self, decay: float = 0.98, min_rounds: int = 16, min_spread: float = 4.0,
                 clamp: tuple[float, float] = (0.5, 4.0)) -> None:
        self.decay = decay
        self.min_rounds = min_rounds
        self.min_spread = min_spread  # variance of ℓ (tokens²) the fit needs
        self.clamp = clamp  # the measured slope stays within these multiples of the profile's
        self._fits: dict[int, _Fit] = {}

    def record(self, batch_size: int, num_verified: int, verify_ms: float, profile: SPSTable) -> None:
        """One round without riding prompts: `num_verified` draft tokens (0 for a plain round) verified
        beside `batch_size` requests' last tokens in `verify_ms`."""
        if batch_size <= 0 or verify_ms <= 0:
            return
        excess = verify_ms - profile.step_time_ms_at(batch_size)
        self._fits.setdefault(band_of(batch_size), _Fit()).add(float(num_verified), excess, self.decay)

    def slope_ms(self, batch_size: int, profile: SPSTable) -> tuple[float, bool]:
        """(ms per verified token at `batch_size`, whether it is measured rather than the profile's)."""
        line = self._line(batch_size)
        return self._slope(line, batch_size, profile), line is not None

    def _slope(self, line: tuple[float, float] | None, batch_size: int, profile: SPSTable) -> float:
        """The line's slope clamped to `clamp` × the profile's; the profile's without a line."""
        span = max(8, batch_size)
        prof = max(1e-6, (profile.step_time_ms_at(batch_size + span) - profile.step_time_ms_at(batch_size)) / span)
        if line is None:
            return prof
        lo, hi = self.clamp
        return min(max(line[1], lo * prof), hi * prof)

    def table(self, batch_size: int, profile: SPSTable) -> SPSTable:
        """The step-time table Algorithm 1 schedules a round of `batch_size` requests on: the measured plain
        time at B tokens (the profile's plus the line's intercept) and the measured slope past it; the profile
        itself while nothing is measured. Both ends measured: Algorithm 1 weighs a token by the slope RELATIVE to
        the plain time, and a real round's plain time exceeds the profile's (32 one-token requests read 32
        contexts where the profile's chunks read 4), so a measured slope on the profile's plain time overprices
        every token."""
        line = self._line(batch_size)
        if line is None:
            return profile
        slope = self._slope(line, batch_size, profile)
        plain = profile.step_time_ms_at(batch_size)
        base = max(0.5 * plain, plain + line[0])
        span = 64 * max(1, batch_size)
        return SPSTable([batch_size, batch_size + span], [base, base + slope * span],
                        {**profile.meta, "measured_slope_ms": round(slope, 4), "measured_plain_ms": round(base, 2)})

    def _line(self, batch_size: int) -> tuple[float, float] | None:
        fit = self._fits.get(band_of(batch_size))
        return fit.line(self.min_rounds, self.min_spread) if fit is not None else None

    def summary(self, profile: SPSTable) -> dict[str, dict]:
        """Per band (its largest batch size): the slope in use and whether it was measured (for stats)."""
        out = {}
        for band in sorted(self._fits):
            size = 1 << band
            slope, measured = self.slope_ms(size, profile)
            out[str(size)] = {"ms_per_token": round(slope, 3), "measured": measured,
                              "rounds": self._fits[band].rounds}
        return out
