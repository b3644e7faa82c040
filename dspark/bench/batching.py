"""`dspark bench batching`: a mixed-length verify batch costs what a uniform one of equal tokens does."""

from __future__ import annotations

import statistics
import time

import torch

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import TargetModel
from dspark.models.target.runner import TargetRunner


def _median_ms(runner: TargetRunner, chunks: list[SeqChunk], num_repeats: int) -> float:
    samples = []
    for i in range(num_repeats + 2):
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.forward(chunks)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def bench_batching(target: TargetModel, context_len: int = 256, num_repeats: int = 9) -> dict:
    """Compare step times, interleaved so machine noise hits both alike."""
    cases = {  # same number of requests and total tokens; lengths are 1 + ℓ_r
        "batch8_32tok": ([4] * 8, [1, 8, 2, 7, 3, 6, 1, 4]),
        "batch16_64tok": ([4] * 16, [1, 8, 8, 1, 2, 7, 4, 5, 3, 6, 8, 1, 1, 4, 2, 3]),
        "batch4_16tok": ([4] * 4, [1, 8, 1, 6]),
    }
    runner = TargetRunner(target.model, 16, context_len + 10)
    slots = [runner.cache.allocate() for _ in range(16)]
    ctx = torch.randint(0, runner.vocab_size, (context_len,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])
    out: dict = {"context_len": context_len, "cases": {}}
    for name, (uniform, mixed) in cases.items():
        assert sum(uniform) == sum(mixed) and len(uniform) == len(mixed)
        u_chunks = [SeqChunk(slots[i], context_len, ctx[:n], n) for i, n in enumerate(uniform)]
        m_chunks = [SeqChunk(slots[i], context_len, ctx[:n], n) for i, n in enumerate(mixed)]
        u, m = [], []
        for _ in range(3):  # interleave rounds
            u.append(_median_ms(runner, u_chunks, num_repeats))
            m.append(_median_ms(runner, m_chunks, num_repeats))
        u_ms, m_ms = statistics.median(u), statistics.median(m)
        out["cases"][name] = {"uniform_ms": u_ms, "mixed_ms": m_ms, "mixed_over_uniform": m_ms / u_ms,
                              "lengths_mixed": mixed, "num_tokens": sum(mixed)}
    out["max_mixed_over_uniform"] = max(c["mixed_over_uniform"] for c in out["cases"].values())
    out["within_15pct"] = out["max_mixed_over_uniform"] <= 1.15
    return out
