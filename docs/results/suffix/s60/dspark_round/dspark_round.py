"""Session 60: one DSpark draft round at batch 1 by itself (hot caches): a request with 299 context rows observed, then
each round one more row observed, projected (`_flush`) and a block of 7 drafted (`propose`), 30 rounds; medians in ms,
and the round's ops by self time (PyTorch's profiler, 10 rounds). One JSON line.
    .venv/bin/python docs/results/suffix/s60/dspark_round/dspark_round.py > dspark_round.json"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

import torch

from dspark.bench.decode import mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.dspark.drafter import DSparkDrafter

target, _, _ = mixed_frame(1, 8)
drafter = DSparkDrafter.from_pretrained("checkpoints/dspark-smollm2", target)
width = drafter.model.config.num_context_features
ids = list(range(100, 400))
gen = torch.Generator().manual_seed(0)
with torch.inference_mode():
    drafter.observe("a", torch.randn(299, width, generator=gen).to(target.dtype))
    request = DraftRequest("a", ids, 0.0)
    for _ in range(5):
        drafter.propose([request], 7)
    propose_ms, flush_ms = [], []
    for _ in range(30):
        drafter.observe("a", torch.randn(1, width, generator=gen).to(target.dtype))
        ids.append(5)
        request = DraftRequest("a", ids, 0.0)
        t0 = time.perf_counter()
        drafter._flush("a")
        t1 = time.perf_counter()
        drafter.propose([request], 7)
        propose_ms.append((time.perf_counter() - t1) * 1e3)
        flush_ms.append((t1 - t0) * 1e3)
    with torch.profiler.profile() as prof:
        for _ in range(10):
            drafter.propose([request], 7)
self_ms: dict[str, float] = defaultdict(float)
calls: dict[str, float] = defaultdict(float)
for evt in prof.key_averages():
    self_ms[evt.key] += evt.self_cpu_time_total / 10 / 1e3
    calls[evt.key] += evt.count / 10
top = sorted(self_ms.items(), key=lambda kv: -kv[1])[:12]
print(json.dumps({"cpu": cpu_signature(), "dtype": str(target.dtype),
                  "propose_ms": round(statistics.median(propose_ms), 3),
                  "flush_one_row_ms": round(statistics.median(flush_ms), 3),
                  "profiled_ops": {k: {"self_ms": round(v, 3), "calls": calls[k]} for k, v in top}}))
