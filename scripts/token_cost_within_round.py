"""What one more verified token costs within a round: the verify forward of B requests, each over a cached
context, timed with every request verifying ℓ draft tokens (ℓ + 1 rows, logits for all of them), against the
profile's verify-shaped chunks (8 tokens a request) of the same token counts. Interleaved repeats, medians.

    .venv/bin/python scripts/token_cost_within_round.py [--batch 32] [--threads 1] [--dtype bf16] > out.json

The forward only: acceptance and the drafter's feature taps are not in it (the engine's verify_ms has them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m-instruct", "cpu", args.dtype)
    b, ctx_len = args.batch, args.context
    runner = TargetRunner(target.model, b, ctx_len + 16, row_invariant=True)
    slots = [runner.cache.allocate() for _ in range(b)]
    ctx = torch.randint(0, runner.vocab_size, (ctx_len,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])
    shapes: dict[str, list[SeqChunk]] = {}
    for extra in (0, 1, 2, 3):  # every request verifies `extra` draft tokens: B·(1 + extra) rows
        n = 1 + extra
        shapes[f"round_{b * n}"] = [SeqChunk(s, ctx_len, ctx[:n], n) for s in slots]
    for extra in (b // 2,):  # half the requests verify one more
        shapes[f"round_{b + extra}"] = [SeqChunk(s, ctx_len, ctx[:1 + (i < extra)], 1 + (i < extra))
                                        for i, s in enumerate(slots)]
    for tokens in sorted({b * (1 + e) for e in (0, 1, 2, 3)} | {b + b // 2}):  # the profile's shape
        sizes = [8] * (tokens // 8) + ([tokens % 8] if tokens % 8 else [])
        shapes[f"profile_{tokens}"] = [SeqChunk(slots[i], ctx_len, ctx[:n], n) for i, n in enumerate(sizes)]
    for chunks in shapes.values():
        runner.forward(chunks)
    samples: dict[str, list[float]] = {k: [] for k in shapes}
    for _ in range(args.repeats):
        for name, chunks in shapes.items():
            t0 = time.perf_counter()
            runner.forward(chunks)
            samples[name].append((time.perf_counter() - t0) * 1e3)
    ms = {k: round(statistics.median(v), 2) for k, v in samples.items()}

    def slope(kind: str) -> float:
        lo, hi = ms[f"{kind}_{b}"], ms[f"{kind}_{2 * b}"]
        return round((hi - lo) / b, 3)

    print(json.dumps({"batch": b, "threads": args.threads, "dtype": args.dtype, "context": ctx_len,
                      "median_ms": ms, "ms_per_extra_token_round_shape": slope("round"),
                      "ms_per_extra_token_profile_shape": slope("profile")}, indent=1))


if __name__ == "__main__":
    main()
