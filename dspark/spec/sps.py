"""SPS(B): target steps per second as a function of tokens per verification step.

Profiled once per device / model / dtype and stored as JSON:
``{"tokens_per_step": [...], "step_time_ms": [...], "meta": {...}}``, optionally with
``"by_requests": {"8": {"tokens_per_step": [...], "step_time_ms": [...]}, ...}``: the same curve measured
for steps of a given number of requests (`SPSTable.for_requests`).
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
    # curves of steps that carry exactly r requests (r -> table over total tokens, all >= r); empty: unknown
    by_requests: dict[int, SPSTable] = field(default_factory=dict)
    _views: dict[int, SPSTable] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens_per_step = [int(n) for n in self.tokens_per_step]
        self.step_time_ms = [float(t) for t in self.step_time_ms]
        _validate(self.tokens_per_step, self.step_time_ms)
        self.by_requests = {int(r): t for r, t in sorted(self.by_requests.items())}
        for r, table in self.by_requests.items():
            if r < 1 or table.tokens_per_step[0] < r:
                raise ValueError(f"the curve of {r} requests must start at >= {r} tokens, got {table.tokens_per_step}")

    def for_requests(self, num_requests: int) -> SPSTable:
        """The step-time curve of a step that carries `num_requests` requests: T(n) for n >= num_requests
        tokens (one per request, the rest verified drafts). A step's time depends on how its tokens split into
        requests, not on their count alone: each request's attention reads its own cached keys and values (Zen 4,
        SmolLM2 bf16: 32 tokens took 35 ms as 4 requests of 8 and 42 ms as 32 of 1; 32 tokens more, 26 and 24 ms).
        The profile's single curve (chunks of 8 tokens) priced a verified token at 32 requests at 1.7x its
        share of the real step. From the curves measured per request count (`by_requests`): as a function of the
        tokens past the requests' own, e = n - r, the two nearest measured counts' curves blended linearly in r
        (the nearest one outside them). Without such curves: this table."""
        if not self.by_requests or num_requests < 1:
            return self
        view = self._views.get(num_requests)
        if view is None:
            counts = list(self.by_requests)
            if num_requests <= counts[0] or num_requests >= counts[-1]:
                lo_r = hi_r = counts[0] if num_requests <= counts[0] else counts[-1]
            else:
                hi = bisect.bisect_left(counts, num_requests)  # counts[hi - 1] < num_requests <= counts[hi]
                lo_r, hi_r = (counts[hi], counts[hi]) if counts[hi] == num_requests else (counts[hi - 1], counts[hi])
            lo_t, hi_t = self.by_requests[lo_r], self.by_requests[hi_r]
            w = 0.0 if hi_r == lo_r else (num_requests - lo_r) / (hi_r - lo_r)
            extras = sorted({0, *(x - lo_r for x in lo_t.tokens_per_step if x >= lo_r),
                             *(x - hi_r for x in hi_t.tokens_per_step if x >= hi_r)})
            times = [(1 - w) * lo_t.step_time_ms_at(lo_r + e) + w * hi_t.step_time_ms_at(hi_r + e) for e in extras]
            view = SPSTable([num_requests + e for e in extras], times, {**self.meta, "num_requests": num_requests})
            self._views[num_requests] = view
        return view

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

    def with_base_tokens(self, extra_tokens: int) -> SPSTable:
        """The table of a step that carries `extra_tokens` more tokens than it schedules (prompts riding in a
        verify forward): T'(n) = T(n + extra_tokens). Such a step is longer, so one more verified token costs
        less of its throughput, and a scheduler given this table verifies accordingly more."""
        if extra_tokens <= 0:
            return self
        xs = [1] + [x - extra_tokens for x in self.tokens_per_step if x - extra_tokens > 1]
        ys = [self.step_time_ms_at(x + extra_tokens) for x in xs]
        if len(xs) == 1 and len(self.tokens_per_step) > 1:  # past the measured points: keep the last slope
            xs.append(2)
            ys.append(self.step_time_ms_at(2 + extra_tokens))
        # the riders' tokens are prompt tokens, not requests: a curve of r requests is read extra_tokens further on
        by_requests = {}
        for r, t in self.by_requests.items():
            rx = [r, r + 1] + [x - extra_tokens for x in t.tokens_per_step if x - extra_tokens > r + 1]
            by_requests[r] = SPSTable(rx, [t.step_time_ms_at(x + extra_tokens) for x in rx])
        return SPSTable(xs, ys, {**self.meta, "base_tokens": extra_tokens}, by_requests)

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
        return SPSTable(list(self.tokens_per_step), fitted, {**self.meta, "monotone": True},
                        {r: t.monotone() for r, t in self.by_requests.items()})

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (see module docstring)."""
        out: dict[str, Any] = {
            "tokens_per_step": list(self.tokens_per_step),
            "step_time_ms": list(self.step_time_ms),
            "meta": dict(self.meta),
        }
        if self.by_requests:
            out["by_requests"] = {str(r): {"tokens_per_step": list(t.tokens_per_step),
                                           "step_time_ms": list(t.step_time_ms)}
                                  for r, t in self.by_requests.items()}
        return out

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SPSTable:
        """Build from the JSON form; raises ValueError on missing keys or invalid values."""
        missing = [key for key in ("tokens_per_step", "step_time_ms") if key not in d]
        if missing:
            raise ValueError(f"SPS profile is missing keys {missing}")
        by_requests = d.get("by_requests") or {}
        if not isinstance(by_requests, dict):
            raise ValueError(f"SPS profile's by_requests must be an object, got {type(by_requests).__name__}")
        return cls(
            tokens_per_step=list(d["tokens_per_step"]),
            step_time_ms=list(d["step_time_ms"]),
            meta=dict(d.get("meta") or {}),
            by_requests={int(r): cls.from_dict(t) for r, t in by_requests.items()},
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
