"""`dspark profile`: target step time against tokens per step, written as an SPS profile."""

from __future__ import annotations

import platform
import statistics
import time

import torch
from tqdm import tqdm

from dspark.models.runner import SeqChunk, TargetRunner
from dspark.models.target import TargetModel
from dspark.spec.sps import SPSTable

DEFAULT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_target(target: TargetModel, grid: tuple[int, ...] = DEFAULT_GRID, context_len: int = 256,
                   tokens_per_request: int = 8, num_repeats: int = 5, num_warmup: int = 2,
                   show_progress: bool = True) -> SPSTable:
    """Median step time of verification-shaped batches: B tokens as ⌈B/8⌉ requests of ≤ 8 tokens,
    each over `context_len` cached tokens (the shape a verify step has)."""
    max_reqs = -(-max(grid) // tokens_per_request)
    runner = TargetRunner(target.model, max_reqs, context_len + tokens_per_request + 1)
    slots = [runner.cache.allocate() for _ in range(max_reqs)]
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, runner.vocab_size, (context_len,), generator=gen).tolist()
    runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])  # fill every slot's context once
    times_ms = []
    for num_tokens in tqdm(grid, desc="profile", unit="B", disable=not show_progress):
        sizes = [tokens_per_request] * (num_tokens // tokens_per_request)
        if num_tokens % tokens_per_request:
            sizes.append(num_tokens % tokens_per_request)
        chunks = [SeqChunk(slots[i], context_len, ctx[:n], n) for i, n in enumerate(sizes)]
        samples = []
        for i in range(num_warmup + num_repeats):
            _sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(chunks)
            _sync(runner.device)
            if i >= num_warmup:
                samples.append((time.perf_counter() - t0) * 1e3)
        times_ms.append(statistics.median(samples))
    from dspark.verify_service.profiles import machine_identity

    meta = {**machine_identity(target.name, target.device, target.dtype),
            "num_threads": torch.get_num_threads(), "context_len": context_len,
            "tokens_per_request": tokens_per_request, "machine": platform.processor() or platform.machine(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    by_tokens = dict(zip(grid, times_ms))
    if 1 in by_tokens:  # the number that decides when speculation pays: T(1 + ℓ) / T(1) at batch 1
        meta["verify_cost_ratio"] = {str(n - 1): round(by_tokens[n] / by_tokens[1], 3)
                                     for n in (2, 4, 8) if n in by_tokens and n <= tokens_per_request}
    return SPSTable(tokens_per_step=list(grid), step_time_ms=times_ms, meta=meta)
