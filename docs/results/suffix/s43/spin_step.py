"""A bf16 SmolLM2 decode step every 5 ms at batch 1 and 32, median ms, under the GOMP_SPINCOUNT of the environment
(session 43: run it with GOMP_SPINCOUNT unset, 300000, 30000, 3000)."""
import json
import os
import statistics
import time

import torch

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
t = load_target("smollm2-135m-instruct", dtype="bf16")
r = TargetRunner(t.model, 32, 1024)
out = {"spin": os.environ.get("GOMP_SPINCOUNT", "default")}
for batch in (1, 32):
    r.forward([SeqChunk(s, 0, list(range(100, 300)), 1) for s in range(batch)])
    chunks = [SeqChunk(s, 200, [42], 1) for s in range(batch)]
    ts = []
    for _ in range(40):
        t0 = time.perf_counter()
        r.forward(chunks)
        ts.append(time.perf_counter() - t0)
        time.sleep(0.005)  # a draft wait between steps
    out[f"b{batch}_ms"] = round(statistics.median(ts[5:]) * 1e3, 2)
print(json.dumps(out))
