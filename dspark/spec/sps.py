"""SPS(B): target steps per second as a function of tokens per verification step.

Profiled once per device / model / dtype and stored as JSON:
``{"tokens_per_step": [...], "step_time_ms": [...], "meta": {...}}``.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class SPSTable:
    """Measured step times at a few batch sizes (in tokens), interpolated in between.

    ``tokens_per_step`` is strictly ascending with first entry >= 1; ``step_time_ms`` holds
    the positive measured step time at each of them.
    """

    tokens_per_step: list[int]
    step_time_ms: list[float]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens_per_step = [int(n) for n in self.tokens_per_step]
        self.step_time_ms = [float(t) for t in self.step_time_ms]
        _validate(self.tokens_per_step, self.step_time_ms)

    def step_time_ms_at(self, num_tokens: int) -> float:
        """Step time for ``num_tokens`` tokens per step.

        Piecewise-linear between measured points; the first point's time below the first
        point; above the last point, the line through the last two points, never below the
        last measured time.
        """
        xs, ys = self.tokens_per_step, self.step_time_ms
        if num_tokens <= xs[0]:
            return ys[0]
        if num_tokens >= xs[-1]:
            if len(xs) == 1:
                return ys[-1]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return max(ys[-1], ys[-1] + slope * (num_tokens - xs[-1]))
        hi = bisect.bisect_left(xs, num_tokens)  # xs[hi - 1] < num_tokens <= xs[hi]
        lo = hi - 1
        weight = (num_tokens - xs[lo]) / (xs[hi] - xs[lo])
        return ys[lo] + weight * (ys[hi] - ys[lo])

    def sps(self, num_tokens: int) -> float:
        """Steps per second at ``num_tokens`` tokens per step: 1000 / `step_time_ms_at`."""
        return 1000.0 / self.step_time_ms_at(num_tokens)

    def with_riders(self, prompt_tokens: int, num_requests: int) -> SPSTable:
        """The table a round of `num_requests` requests schedules on when `prompt_tokens` prompt tokens ride in its
        forward: T'(n) = T(r) + T(P + n) - T(P + r) (r requests, P prompt tokens), the step time of a round without
        riders plus what its n - r verified drafts add to the forward that carries the prompts.

        Algorithm 1 admits a draft while it raises expected tokens / T', i.e. while its survival beats its own
        marginal cost at the plain step's tokens per ms: a token verified beside a prompt is worth what it would
        cost in a plain step, not a share of the prompts' forward. Scheduling on T(P + n) (the longer step's own
        throughput, until session 55) made any draft look cheap beside a prompt: on the Zen 4 EPYC, 4 x B new
        prompts through B slots, the hybrid went from 0.989 to 1.014x target-only at batch 8 and from 0.970 to
        1.011x at batch 32, its rider rounds from 2.9 to 2.6 s and from 14.2 to 10.4 s a run
        (docs/results/suffix/s55/riders). Where a rider forward prices a row below the plain steps' time per token
        (a 1-thread AMX Xeon at batch 30: ~1.6 against ~2 ms), the rounds still verify more than plain steps do."""
        if prompt_tokens <= 0:
            return self
        r = max(1, num_requests)
        base = self.step_time_ms_at(r) - self.step_time_ms_at(prompt_tokens + r)
        xs = [r] + [x - prompt_tokens for x in self.tokens_per_step if x - prompt_tokens > r]
        if len(xs) == 1 and len(self.tokens_per_step) > 1:  # past the measured points: keep the last slope
            xs.append(r + 1)
        ys = [base + self.step_time_ms_at(x + prompt_tokens) for x in xs]
        return SPSTable(xs, ys, {**self.meta, "rider_tokens": prompt_tokens})

    def monotone(self) -> SPSTable:
        """A copy whose step times never fall as tokens grow (isotonic least-squares fit).

        A measured profile is jagged (one matmul shape happens to be faster than a smaller one); a
        scheduler that trusts a dip would verify extra tokens "for free" that are not free in service.
        Pool-adjacent-violators: each run of decreasing times is replaced by its mean.
        """
        blocks: list[list[float]] = []  # [sum, count] of each pooled run
        for t in self.step_time_ms:
            blocks.append([t, 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        fitted = [total / count for total, count in blocks for _ in range(int(count))]
        return SPSTable(list(self.tokens_per_step), fitted, {**self.meta, "monotone": True})

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (see module docstring)."""
        return {
            "tokens_per_step": list(self.tokens_per_step),
            "step_time_ms": list(self.step_time_ms),
            "meta": dict(self.meta),
        }

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SPSTable:
        """Build from the JSON form; raises ValueError on missing keys or invalid values."""
        missing = [key for key in ("tokens_per_step", "step_time_ms") if key not in d]
        if missing:
            raise ValueError(f"SPS profile is missing keys {missing}")
        return cls(
            tokens_per_step=list(d["tokens_per_step"]),
            step_time_ms=list(d["step_time_ms"]),
            meta=dict(d.get("meta") or {}),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> SPSTable:
        """Load a profile written by `save`."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"SPS profile {path} is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"SPS profile {path} must hold a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_sps(cls, sps_by_tokens: dict[int, float], meta: dict[str, Any] | None = None) -> SPSTable:
        """Build from steps-per-second values, e.g. ``{1: 1.0, 2: 0.5, 3: 0.45}``."""
        if any(not sps > 0 for sps in sps_by_tokens.values()):
            raise ValueError(f"SPS values must be positive, got {sps_by_tokens}")
        tokens = sorted(sps_by_tokens)
        return cls(
            tokens_per_step=tokens,
            step_time_ms=[1000.0 / sps_by_tokens[n] for n in tokens],
            meta=dict(meta or {}),
        )


def _validate(tokens_per_step: list[int], step_time_ms: list[float]) -> None:
    if not tokens_per_step:
        raise ValueError("SPS profile needs at least one measured point")
    if len(tokens_per_step) != len(step_time_ms):
        raise ValueError(
            f"SPS profile has {len(tokens_per_step)} tokens_per_step entries but "
            f"{len(step_time_ms)} step_time_ms entries"
        )
    if tokens_per_step[0] < 1:
        raise ValueError(f"tokens_per_step must start at >= 1, got {tokens_per_step[0]}")
    for prev, cur in itertools.pairwise(tokens_per_step):
        if cur <= prev:
            raise ValueError(f"tokens_per_step must be strictly ascending, got {tokens_per_step}")
    for t in step_time_ms:
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"step_time_ms must be positive and finite, got {step_time_ms}")
