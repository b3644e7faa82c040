"""SPS(B): target steps per second as a function of tokens per verification step.

Profiled once per device / model / dtype and stored as JSON:
``{"tokens_per_step": [...], "step_time_ms": [...], "meta": {...}}``, optionally with
``"by_requests": {"R": {"tokens_per_step": [...], "step_time_ms": [...]}, ...}``: the same measured in the shape a
decode step of R requests has (R requests of one token each plus the verified drafts, spread over them), which
`for_requests` reads.
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
    # step times of R requests a step (R >= 2), at R + n tokens: see `for_requests`
    by_requests: dict[int, SPSTable] = field(default_factory=dict)
    _per_request: dict[int, SPSTable] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens_per_step = [int(n) for n in self.tokens_per_step]
        self.step_time_ms = [float(t) for t in self.step_time_ms]
        _validate(self.tokens_per_step, self.step_time_ms)
        self.by_requests = {int(r): row for r, row in sorted(self.by_requests.items())}
        for r, row in self.by_requests.items():
            if r < 2 or row.tokens_per_step[0] < r:
                raise ValueError(f"a row of {r} requests needs r >= 2 and >= r tokens, got {row.tokens_per_step}")

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

    def for_requests(self, num_requests: int) -> SPSTable:
        """The table a step of `num_requests` requests schedules on: step time against its tokens (requests + drafts
        verified), from the rows measured in that shape (`by_requests`), interpolated between the two nearest row
        sizes at the same number of verified drafts (below the smallest row, between this table's one-request
        steps and it); past a row's last point, that point plus what this table adds from there. Without rows, or
        for one request (this table's small sizes are one request's steps), this table itself.

        Why: this table's shape (⌈B / 8⌉ requests of 8 tokens) is a batch-1 verify step's, not a batched one's. On
        a 2-core Zen 5 EPYC (session 61, bf16 SmolLM2, 300 cached tokens a request) 16 requests of one token took
        16.0 ms and 4 / 8 / 16 verified drafts more 16.7 / 18.4 / 21.1 ms, while the table read T(16) 15.8 and
        T(20) 22.0 ms: a draft token priced ~10x its cost, and at 16 requests Algorithm 1 verified none."""
        if num_requests < 2 or not self.by_requests:
            return self
        table = self._per_request.get(num_requests)
        if table is None:
            table = self._per_request[num_requests] = self._requests_table(num_requests)
        return table

    def _requests_table(self, r: int) -> SPSTable:
        sizes = list(self.by_requests)
        if r in self.by_requests:
            lo = hi = r
        elif r < sizes[0]:
            lo, hi = 1, sizes[0]
        elif r > sizes[-1]:
            lo = hi = sizes[-1]
        else:
            hi = next(s for s in sizes if s > r)
            lo = max(s for s in sizes if s < r)

        def row(size: int) -> SPSTable:
            return self if size == 1 else self.by_requests[size]

        extras = sorted({x - s for s in {lo, hi} for x in row(s).tokens_per_step if x >= s})
        w = 0.0 if hi == lo else (r - lo) / (hi - lo)
        shift = self.step_time_ms_at(r) - self.step_time_ms_at(lo) if r > hi else 0.0  # past the largest row
        ys = [(1 - w) * row(lo).step_time_ms_at(lo + n) + w * row(hi).step_time_ms_at(hi + n) + shift for n in extras]
        xs = [r + n for n in extras]
        last_x, last_y = xs[-1], ys[-1]
        for x in self.tokens_per_step:  # past the rows' points: this table's own growth from there
            if x > last_x:
                xs.append(x)
                ys.append(last_y + self.step_time_ms_at(x) - self.step_time_ms_at(last_x))
        return SPSTable(xs, ys, {**self.meta, "num_requests": r})

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
        rows = {r: row.monotone() for r, row in self.by_requests.items()}
        return SPSTable(list(self.tokens_per_step), fitted, {**self.meta, "monotone": True}, rows)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (see module docstring)."""
        out: dict[str, Any] = {
            "tokens_per_step": list(self.tokens_per_step),
            "step_time_ms": list(self.step_time_ms),
            "meta": dict(self.meta),
        }
        if self.by_requests:
            out["by_requests"] = {str(r): {"tokens_per_step": list(row.tokens_per_step),
                                           "step_time_ms": list(row.step_time_ms)}
                                  for r, row in self.by_requests.items()}
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
        rows = {}
        for r, row in (d.get("by_requests") or {}).items():
            if not isinstance(row, dict) or any(key not in row for key in ("tokens_per_step", "step_time_ms")):
                raise ValueError(f"SPS profile row {r!r} of by_requests needs tokens_per_step and step_time_ms")
            rows[int(r)] = cls(list(row["tokens_per_step"]), list(row["step_time_ms"]))
        return cls(
            tokens_per_step=list(d["tokens_per_step"]),
            step_time_ms=list(d["step_time_ms"]),
            meta=dict(d.get("meta") or {}),
            by_requests=rows,
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
