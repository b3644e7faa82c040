"""What a round costs beside its forward, for the step time Algorithm 1 schedules on.

Algorithm 1 (`spec/schedulers.py`) picks verification lengths by Θ = E[tokens] · SPS(n), SPS from the profile's
forward time T(n). A verified token saves a whole round, though: the forward and what the round spends around it
that does not grow with its tokens (drafting, scheduling, committing, streaming the replies and the serving loop
until the next round). Scheduling on T(n) alone prices one more token as a larger share of the round than it is,
and verifies too little where that time is large (at batch 16 ~3 ms beside a ~21 ms forward on a 2-core Zen 4
EPYC). `RoundCost` keeps a decayed mean of that time F(B) per batch size from the engine's rounds, and the engine
schedules on T(n) + F(B) (`SPSTable.with_fixed_ms`).

Lossless: it depends on past rounds' timings only, never on the tokens being verified.
"""

from __future__ import annotations


class RoundCost:
    """Decayed mean, per batch size, of a round's time outside its verify forward."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self._ms: dict[int, float] = {}

    def record(self, batch_size: int, outside_ms: float) -> None:
        """One round of `batch_size` requests spent `outside_ms` beside its forward (negative: clipped to 0)."""
        x = max(0.0, outside_ms)
        old = self._ms.get(batch_size)
        self._ms[batch_size] = x if old is None else self.decay * old + (1.0 - self.decay) * x

    def fixed_ms(self, batch_size: int) -> float:
        """F(B): the mean at `batch_size`, else at the nearest batch size measured (the smaller on a tie), else 0."""
        if batch_size in self._ms:
            return self._ms[batch_size]
        if not self._ms:
            return 0.0
        return self._ms[min(self._ms, key=lambda b: (abs(b - batch_size), b))]
