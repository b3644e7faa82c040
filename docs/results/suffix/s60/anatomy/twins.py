"""Session 60: how far apart two identical arms read in one side-by-side run. K target-only engines (each with its own
packed weights, as every arm of `bench decode` has; `share`: the later ones run on the first one's weights), in turn
on each of N mixed eval prompts (order reversed every other prompt), 128 greedy tokens; each engine's median 1-token
forward in ms. One JSON line.
    .venv/bin/python docs/results/suffix/s60/anatomy/twins.py N K [share] >> twins.jsonl"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.models.target.runner import TargetRunner
from dspark.verify_service.request import SamplingParams

N, K = int(sys.argv[1]), int(sys.argv[2])
SHARE = len(sys.argv) > 3 and sys.argv[3] == "share"
forward_ms: dict[int, list[float]] = collections.defaultdict(list)
forward = TargetRunner.forward


def timed(self, chunks, hidden_layers=()):  # noqa: ANN001, ANN202 - the runner's own signature
    t0 = time.perf_counter()
    out = forward(self, chunks, hidden_layers)
    if sum(len(c.token_ids) for c in chunks) == 1:
        forward_ms[id(self)].append((time.perf_counter() - t0) * 1e3)
    return out


TargetRunner.forward = timed
target, labelled, max_len = mixed_frame(N, 128)
engines = [_engine(BASE, target, 1, max_len, "greedy", 7, None, True, {}) for _ in range(K)]
if SHARE:
    first = engines[0].runner
    for e in engines[1:]:
        for mine, theirs in zip(e.runner.layers, first.layers):
            mine.qkv, mine.o, mine.gate_up, mine.down = theirs.qkv, theirs.o, theirs.gate_up, theirs.down
        e.runner.lm_head = first.lm_head
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)
forward_ms.clear()
for i, (_, prompt) in enumerate(labelled):
    for e in (engines if i % 2 == 0 else engines[::-1]):
        e.generate([prompt], params)
ms = [round(statistics.median(forward_ms[id(e.runner)]), 2) for e in engines]
print(json.dumps({"cpu": cpu_signature(), "prompts": N, "shared_weights": SHARE, "median_ms": ms,
                  "spread": round(max(ms) / min(ms) - 1, 3)}))
