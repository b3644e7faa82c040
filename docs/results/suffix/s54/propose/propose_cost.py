"""Session 54: what one proposal round of the hybrid costs in the engine's terms for B requests (the issue's budget:
32 requests for <= 3 % of a batch-1 verify step). B mixed eval prompts, each grown by one token a round (the engine's
`DraftRequest`s: id, all tokens, temperature, tenant), ROUNDS rounds of `HybridDrafter.propose` (request and corpus
sources, as the bench arms; DSpark forgone for every request, as the features gate leaves it on this CPU), greedy; the
median ms of a round's proposal (verdicts untimed), and under cProfile (verdicts included) the top functions by own
time. One JSON line.
--cold: 256 MB read before each round (a forward's weights leave the caches so).
    .venv/bin/python docs/results/suffix/s54/propose/propose_cost.py [B] [ROUNDS] [--cold]"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import numpy as np

from dspark.bench.decode import mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.hybrid import HybridDrafter

B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 300
COLD = "--cold" in sys.argv  # 256 MB read between rounds, as a forward streams the weights through the caches
sweep = np.ones(2**26, dtype=np.float32) if COLD else None
target, labelled, _ = mixed_frame(B, 128)
drafter = HybridDrafter.build(target, sources=["request", "corpus"])
tokens = [list(p) for _, p in labelled]
ids = [f"r{i}" for i in range(B)]
for rid in ids:
    drafter.forgo_features(rid)
filler = [t for p in tokens for t in p]


def round_(k: int) -> float:
    """One round: every request one token longer, the proposal (timed: the engine's draft_ms) and its verdict."""
    for i, t in enumerate(tokens):
        t.append(filler[(k * B + i) % len(filler)])
    if sweep is not None:
        sweep.sum()
    t0 = time.perf_counter()
    drafter.propose([DraftRequest(rid, t, 0.0, "") for rid, t in zip(ids, tokens)], 7)
    ms = (time.perf_counter() - t0) * 1e3
    drafter.feedback(ids, [0] * B, [0] * B)
    return ms


for k in range(20):
    round_(k)
times = [round_(k) for k in range(ROUNDS)]
prof = cProfile.Profile()
prof.enable()
for k in range(ROUNDS):
    round_(k)
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
print(s.getvalue(), file=sys.stderr)
print(json.dumps({"cpu": cpu_signature(), "requests": B, "rounds": ROUNDS, "cold": COLD,
                  "round_ms_median": round(statistics.median(times), 3),
                  "round_ms_p90": round(sorted(times)[int(0.9 * len(times))], 3)}))
