"""Session 56: where a bf16 verify forward's time goes at 8 requests (300 cached tokens a slot, 2 threads) for 8 rows,
8 + 8 drafts (2 tokens a request) and 16 requests: torch.profiler self time per op, native kernels as their
ranges (`native.traced`), 20 forwards each after 5 warm-up. Prints the top ops per shape.
    .venv/bin/python docs/results/suffix/s56/forward/op_split.py"""

import torch
from torch.profiler import ProfilerActivity, profile

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
target = load_target(dtype="bf16")
runner = TargetRunner(target.model, 32, 1024)
slots = [runner.cache.allocate() for _ in range(32)]
gen = torch.Generator().manual_seed(0)
ctxs = [torch.randint(4, 40000, (300,), generator=gen).tolist() for _ in range(32)]
SHAPES = {"8x1": [1] * 8, "8:+8": [2] * 8, "16x1": [1] * 16}
with torch.inference_mode():
    for s, c in zip(slots, ctxs):
        runner.forward([SeqChunk(s, 0, c, 1)])
    for k, lengths in SHAPES.items():
        chunks = [SeqChunk(slots[i], 300, ctxs[i][:n], n) for i, n in enumerate(lengths)]
        for _ in range(5):
            runner.forward(chunks)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                runner.forward(chunks)
        tab = {e.key: e.self_cpu_time_total / 20 / 1e3 for e in prof.key_averages()}
        tot = sum(tab.values())
        top = sorted(tab.items(), key=lambda kv: -kv[1])[:14]
        print(k, "total self ms", round(tot, 2))
        for name, ms in top:
            print("   ", name[:60], round(ms, 3))
