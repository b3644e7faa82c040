"""Session 61, Zen 5 EPYC: the batched shape of `real_vs_profile.py` at several context lengths in turn (one runner
each), to tell a context length's own cost from the host's slow stretches. One JSON line of medians.
    .venv/bin/python docs/results/suffix/s61/shape/contexts.py B N1,N2,... REPS CTX1,CTX2,... >> shape.jsonl"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from dspark.models.target.loader import load_target
from dspark.models.target.runner import SeqChunk, TargetRunner

torch.set_num_threads(2)
target = load_target("smollm2-135m-instruct", "cpu", torch.bfloat16)
B, EXTRAS, REPS = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
CTXS = [int(x) for x in sys.argv[4].split(",")]
gen = torch.Generator().manual_seed(0)
shapes = []
for ctx_len in CTXS:
    runner = TargetRunner(target.model, B, ctx_len + 20, row_invariant=True)
    slots = [runner.cache.allocate() for _ in range(B)]
    ctx = torch.randint(0, runner.vocab_size, (ctx_len,), generator=gen).tolist()
    runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])
    for e in EXTRAS:
        sizes = [1 + e // B + (i < e % B) for i in range(B)]
        shapes.append((f"ctx{ctx_len}+{e}", runner, [SeqChunk(slots[i], ctx_len, ctx[:k], k)
                                                     for i, k in enumerate(sizes)]))
for _, r, c in shapes:
    r.forward(c)
ms: dict[str, list[float]] = {name: [] for name, _, _ in shapes}
for i in range(REPS):
    for name, r, c in shapes if i % 2 == 0 else shapes[::-1]:
        r.forward(c)
        t0 = time.perf_counter()
        r.forward(c)
        ms[name].append((time.perf_counter() - t0) * 1e3)
print(json.dumps({"B": B, "median_ms": {k: round(statistics.median(v), 2) for k, v in ms.items()}}))
