"""Session 52: the whole bf16 forward (`TargetRunner`, SmolLM2, 2 threads) with its packed weights and KV cache on
huge pages (kernels/huge_pages.py) against the same on 4 KiB pages (DSPARK_HUGE_PAGES=0 while that runner packs and
allocates), in one process: two copies of the target, each runner's caches filled by the same prefill, logits
compared bit for bit, then each runner's time at R x L tokens (R slots of 300 cached tokens, L new tokens each),
9 turns of 5 forwards in turn, medians. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s52/huge_pages/forward_ab.py [RxL ...] > forward_ab.json"""

import json
import os
import statistics
import sys
import time

import torch

from dspark.kernels import huge_pages
from dspark.kernels.machine import cpu_signature
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
shapes = [tuple(map(int, a.split("x"))) for a in (sys.argv[1:] or ["1x1", "1x8", "4x1", "4x4", "8x1", "8x2",
                                                                 "16x1", "32x1"])]
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 49000, (300,), generator=gen).tolist() for _ in range(32)]
runners = {}
for name, flag in (("4k", "0"), ("huge", "1")):
    os.environ[huge_pages.ENV] = flag
    runner = TargetRunner(load_target(dtype="bf16").model, 32, 512)
    for s in range(0, 32, 4):  # the caches filled by a real prefill (packs the weights on first use)
        runner.forward([SeqChunk(s + i, 0, prompts[s + i], 1) for i in range(4)])
    runners[name] = runner
os.environ[huge_pages.ENV] = "1"
res, ok = [], True
for R, L in shapes:
    chunks = [SeqChunk(s, 300, torch.randint(0, 49000, (L,), generator=gen).tolist(), L) for s in range(R)]
    same = torch.equal(runners["4k"].forward(chunks).logits, runners["huge"].forward(chunks).logits)
    ok &= same
    times: dict[str, list[float]] = {n: [] for n in runners}
    for turn in range(9):
        for name in (list(runners) if turn % 2 == 0 else list(runners)[::-1]):
            t0 = time.perf_counter()
            for _ in range(5):
                runners[name].forward(chunks)
            times[name].append((time.perf_counter() - t0) / 5 * 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    res.append({"slots": R, "tokens_each": L, **{f"{n}_ms": round(m, 2) for n, m in med.items()},
                "huge_over_4k": round(med["huge"] / med["4k"], 3), "logits_identical": same})
    print(res[-1], file=sys.stderr, flush=True)
with open("/proc/self/smaps_rollup") as f:
    anon_huge = next((line.split()[1] for line in f if line.startswith("AnonHugePages")), None)
print(json.dumps({"cpu": cpu_signature(), "anon_huge_pages_kb": anon_huge, "all_identical": ok, "forward": res}))
