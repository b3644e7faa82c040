"""Paired A/B in one process: a 32-request (and 1-request) decode step of SmolLM2 with the rotary table and
with cos / sin computed per step (the table switched off on the same runner), interleaved."""
import json
import statistics
import sys
import time

import torch

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

dtype = sys.argv[1] if len(sys.argv) > 1 else "bf16"
torch.set_num_threads(2)
t = load_target("smollm2-135m-instruct", dtype=dtype)
r = TargetRunner(t.model, 32, 1024)
table = r.rotary_table
out = {"dtype": dtype, "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": ")}
for batch in (1, 32):
    # a context of 200 tokens per slot, then one-token decode steps at position 200
    r.forward([SeqChunk(s, 0, list(range(100, 300)), 1) for s in range(batch)])
    chunks = [SeqChunk(s, 200, [42], 1) for s in range(batch)]
    times = {"table": [], "per_step": []}
    for i in range(60):
        for arm in (("table", "per_step") if i % 2 == 0 else ("per_step", "table")):
            r.rotary_table = table if arm == "table" else None
            t0 = time.perf_counter()
            r.forward(chunks)
            times[arm].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[10:]) * 1e3 for k, v in times.items()}
    out[f"batch{batch}"] = {"table_ms": med["table"], "per_step_ms": med["per_step"],
                            "ratio": med["per_step"] / med["table"]}
print(json.dumps(out))
