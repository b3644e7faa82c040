"""Session 59: does a forward's time depend on the step before it? The target's bf16 runner on 32 slots of 256 cached
tokens (as `dspark profile` builds it); 40 times: a 256-token step (untimed), then three 1-token steps, an 8-, a 4-,
a 2- and a 1-token step, each timed. Medians in ms, one JSON line. In `dspark profile`'s round-robin (before this
session) the 1-token sample came right after the 256-token one.
    .venv/bin/python docs/results/suffix/s59/profile/after_big.py"""

from __future__ import annotations

import json
import statistics
import time

import torch

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
runner = TargetRunner(load_target(dtype="bf16").model, 32, 265, row_invariant=True)
slots = [runner.cache.allocate() for _ in range(32)]
ctx = torch.randint(0, runner.vocab_size, (256,), generator=torch.Generator().manual_seed(0)).tolist()
runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])


def chunks(n: int) -> list[SeqChunk]:  # n tokens as requests of <= 8, each over the 256 cached
    sizes = [8] * (n // 8) + ([n % 8] if n % 8 else [])
    return [SeqChunk(slots[i], 256, ctx[:k], k) for i, k in enumerate(sizes)]


def timed(step: list[SeqChunk]) -> float:
    t0 = time.perf_counter()
    runner.forward(step)
    return (time.perf_counter() - t0) * 1e3


one, two, four, eight, big = chunks(1), chunks(2), chunks(4), chunks(8), chunks(256)
for _ in range(3):
    timed(big), timed(one)
order = (("1_after_256", one), ("1_second", one), ("1_third", one), ("8_after_1", eight), ("4", four), ("2", two),
         ("1_after_2", one))
res: dict[str, list[float]] = {name: [] for name, _ in order}
for _ in range(40):
    timed(big)
    for name, step in order:
        res[name].append(timed(step))
print(json.dumps({name: round(statistics.median(v), 2) for name, v in res.items()}))
