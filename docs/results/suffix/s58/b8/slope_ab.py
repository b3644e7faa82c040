"""Session 58: batch 8, the hybrid scheduling on the shipped SPS profile against the same profile with its slope past
8 tokens replaced by the verify forward's measured one at 8 slots (0.6 ms a row on a 16.5 ms step: the profile's
chunks of 8 tokens a request price a row ~50 % higher, its 8 -> 16 tokens 13.38 -> 20.65 ms). Target-only and the two
hybrids (Algorithm 1, the draft gate on) in turn, 32 mixed eval prompts through 8 slots, 128 tokens, ROUNDS rounds
(`dspark.bench.decode.hybrid_variants_in_turn`). One JSON line.
    .venv/bin/python docs/results/suffix/s58/b8/slope_ab.py [ROUNDS] [SLOPE] > slope_ab.json"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.spec.sps import SPSTable

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SLOPE = float(sys.argv[2]) if len(sys.argv) > 2 else 0.6 / 16.5  # a row's time as a share of the 8-slot step
target, labelled, max_len = mixed_frame(32, 128)
prompts = [p for _, p in labelled]


def flatter(engine) -> None:  # noqa: ANN001 - an Engine
    t = engine.sps
    at8 = t.step_time_ms_at(8)
    xs = list(range(1, 129))
    engine.sps = SPSTable(xs, [t.step_time_ms_at(x) if x <= 8 else at8 * (1 + SLOPE * (x - 8)) for x in xs],
                          dict(t.meta))


summary, _ = hybrid_variants_in_turn(target, prompts, max_len, 8, 128, ROUNDS,
                                     {"profile": lambda e: None, "measured_slope": flatter})
print(json.dumps(summary))
