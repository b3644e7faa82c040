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
                   show_progress: bool = True, row_invariant: bool = True) -> SPSTable:
    """Median step time of verification-shaped batches: B tokens as ⌈B/8⌉ requests of ≤ 8 tokens,
    each over `context_len` cached tokens (the shape a verify step has). `row_invariant`: the verify
    engine's kernels (the default; what the schedulers' profile describes), else the generation path's."""
    max_reqs = -(-max(grid) // tokens_per_request)
    runner = TargetRunner(target.model, max_reqs, context_len + tokens_per_request + 1, row_invariant=row_invariant)
    slots = [runner.cache.allocate() for _ in range(max_reqs)]
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, runner.vocab_size, (context_len,), generator=gen).tolist()
    runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])  # fill every slot's context once
    batches = []
    for num_tokens in grid:
        sizes = [tokens_per_request] * (num_tokens // tokens_per_request)
        if num_tokens % tokens_per_request:
            sizes.append(num_tokens % tokens_per_request)
        batches.append([SeqChunk(slots[i], context_len, ctx[:n], n) for i, n in enumerate(sizes)])
    for chunks in batches:
        for _ in range(num_warmup):
            runner.forward(chunks)
    # round-robin: each repeat times every size once, so a burst of noise from a shared host lands on
    # one sample of many sizes (the median drops it) instead of on every sample of one size
    samples: list[list[float]] = [[] for _ in grid]
    bar = tqdm(total=num_repeats * len(grid), desc="profile", unit="step", disable=not show_progress)
    for _ in range(num_repeats):
        for chunks, out in zip(batches, samples):
            _sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(chunks)
            _sync(runner.device)
            out.append((time.perf_counter() - t0) * 1e3)
            bar.update()
    bar.close()
    times_ms = [statistics.median(s) for s in samples]
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
