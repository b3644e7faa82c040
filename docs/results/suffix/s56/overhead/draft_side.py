"""Session 56: the draft worker's `DraftService.handle` for B requests of the hybrid (request + corpus sources, no
DSpark), each round 2 new tokens a request and the verdicts of the last, hot and after a 15 ms 2-thread bf16 compute
burst in the same process (as a verify forward leaves the caches between two rounds of the decoupled arm); median
ms over 180 rounds each, then a cProfile of 300 hot rounds.
    .venv/bin/python docs/results/suffix/s56/overhead/draft_side.py B"""
import cProfile
import pstats
import random
import statistics
import sys
import time

import torch

from dspark.draft_service.service import DraftService
from dspark.models.drafters.registry import make_drafter
from dspark.models.target.loader import load_target

B = int(sys.argv[1])
torch.set_num_threads(1)
target = load_target(dtype="bf16")
drafter = make_drafter("hybrid", target, sources=["request", "corpus"], use_model=False)
svc = DraftService(drafter)
tok = target.tokenizer
text = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "The answer is computed step by step. First, we add the numbers.")
ids = tok(text)["input_ids"]
hist = {f"r{i}": list(ids) for i in range(B)}
a = torch.randn(32, 576, dtype=torch.bfloat16)
w = torch.randn(576, 4096, dtype=torch.bfloat16)
def msg(seq, first):
    reqs = []
    for rid, h in hist.items():
        new = h if first else h[-2:]
        reqs.append({"id": rid, "new_tokens": list(new), "temperature": 0.0, "num_features": 0, "tenant": ""})
    return {"kind": "draft", "seq": seq, "max_num_tokens": 7, "requests": reqs, "features": None, "released": [],
            "forgone": [], "verdicts": [(rid, 3, 1) for rid in hist] if not first else []}
svc.handle(msg(0, True))
random.seed(0)
def step(seq, burst):
    for h in hist.values():
        h.extend(random.sample(ids, 2))
    if burst:
        torch.set_num_threads(2)
        t_end = time.perf_counter() + 0.015
        while time.perf_counter() < t_end:
            a @ w
        torch.set_num_threads(1)
    m = msg(seq, False)
    t0 = time.perf_counter()
    svc.handle(m)
    return (time.perf_counter() - t0) * 1e3
for burst in (False, True):
    ts = [step(i, burst) for i in range(1, 200)]
    print("B", B, "burst" if burst else "hot", "handle ms p50", round(statistics.median(ts[20:]), 3))
pr = cProfile.Profile()
pr.enable()
for i in range(300):
    step(1000 + i, False)
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
