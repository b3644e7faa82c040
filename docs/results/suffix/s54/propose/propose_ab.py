"""Session 54: the suffix kernels (`suffix_kernels.c`) of a base commit against this checkout's, side by side in one
process: both built as `suffix_native.library()` builds them (`kernel_ab.kernel_libraries`), and one proposal round
of the hybrid for B requests (as `propose_cost.py`: mixed eval prompts grown a token a round, request and corpus
sources, greedy) taken on either in alternating order, with 256 MB read before every round (a forward leaves the
caches so). Every round's walks are compared between the two builds (tokens, frequencies, counts, matches, survival:
bit for bit). Median ms a round. One JSON line.
    .venv/bin/python docs/results/suffix/s54/propose/propose_ab.py [BASE_COMMIT] [B] [ROUNDS]"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from dspark.bench.decode import mixed_frame
from dspark.bench.kernel_ab import kernel_libraries, use_library
from dspark.kernels import suffix_native
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.hybrid import HybridDrafter

BASE = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 32
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 200
libs = kernel_libraries(BASE, module=suffix_native)


def use(name: str) -> None:
    use_library(libs, name, module=suffix_native)


use("head")
target, labelled, _ = mixed_frame(B, 128)
drafter = HybridDrafter.build(target, sources=["request", "corpus"])
for i in range(B):  # DSpark out, as the features gate leaves it on this CPU
    drafter.forgo_features(f"r{i}")
tokens = [list(p) for _, p in labelled]
filler = [t for p in tokens for t in p]
sweep = np.ones(2**26, dtype=np.float32)
times: dict[str, list[float]] = {n: [] for n in libs}
identical = True
for k in range(ROUNDS + 10):
    for i, t in enumerate(tokens):
        t.append(filler[(k * B + i) % len(filler)])
    reqs = [DraftRequest(f"r{i}", t, 0.0, "") for i, t in enumerate(tokens)]
    walks = {}
    for name in (["base", "head"] if k % 2 == 0 else ["head", "base"]):
        use(name)
        sweep.sum()
        t0 = time.perf_counter()
        out = drafter.propose(reqs, 7)
        ms = (time.perf_counter() - t0) * 1e3
        batch = drafter.suffix._batch
        walks[name] = [(batch.walk(r, s).tokens, batch.walk(r, s).freq, batch.walk(r, s).count,
                        batch.walk(r, s).match, batch.walk(r, s).conf) for r in range(B) for s in range(3)]
        walks[name + "_out"] = out.tokens
        if k >= 10:
            times[name].append(ms)
    identical &= walks["base"] == walks["head"] and walks["base_out"] == walks["head_out"]
med = {n: statistics.median(v) for n, v in times.items()}
print(json.dumps({"cpu": cpu_signature(), "base": BASE, "requests": B, "rounds": ROUNDS,
                  **{f"{n}_ms": round(v, 3) for n, v in med.items()},
                  "head_over_base": round(med["head"] / med["base"], 3), "walks_identical": identical}))
