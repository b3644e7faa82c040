"""Session 55: what verified rows add to a bf16 verify forward at 8 requests (300 cached tokens a slot, 2 threads):
shapes given as tokens per request, all timed in turn REPS times (interleaved, so the host's drift falls on every
shape alike); prints per shape [total rows, median ms, ratio to 8 x 1]. 8:+k = 8 requests carrying k drafts between
them; "one" / "two": those drafts on one or two requests; 12x1 / 16x1: more requests instead.
    .venv/bin/python docs/results/suffix/s55/forward/rowcost.py [REPS]"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from dspark.kernels.machine import cpu_signature
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
target = load_target(dtype="bf16")
runner = TargetRunner(target.model, 32, 1024)
slots = [runner.cache.allocate() for _ in range(32)]
gen = torch.Generator().manual_seed(0)
ctxs = [torch.randint(4, 40000, (300,), generator=gen).tolist() for _ in range(32)]
SHAPES = {"8x1": [1] * 8, "8:+2": [2, 2] + [1] * 6, "8:+4": [2] * 4 + [1] * 4, "8:+6": [2] * 6 + [1] * 2,
          "8:+8": [2] * 8, "8:+12": [3] * 4 + [2] * 4, "8:+4 one": [5] + [1] * 7, "8:+8 two": [5, 5] + [1] * 6,
          "16x1": [1] * 16, "12x1": [1] * 12}
times: dict[str, list[float]] = {k: [] for k in SHAPES}
with torch.inference_mode():
    for s, c in zip(slots, ctxs):
        runner.forward([SeqChunk(s, 0, c, 1)])
    for _ in range(REPS):
        for k, lengths in SHAPES.items():
            chunks = [SeqChunk(slots[i], 300, ctxs[i][:n], n) for i, n in enumerate(lengths)]
            t0 = time.perf_counter()
            runner.forward(chunks)
            times[k].append((time.perf_counter() - t0) * 1e3)
base = statistics.median(times["8x1"][3:])
print(json.dumps({"cpu": cpu_signature(), "reps": REPS,
                  "shapes": {k: [sum(SHAPES[k]), round(statistics.median(v[3:]), 2),
                                 round(statistics.median(v[3:]) / base, 3)] for k, v in times.items()}}))
