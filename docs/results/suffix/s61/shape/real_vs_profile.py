"""Session 61, Zen 5 EPYC: a verify step's forward in a batched decode step's shape against the SPS profile's shape.
`real`: B requests of one token plus n drafts spread over them (one more token for each of the first n); `prof`: the
profile's B + n tokens as ⌈(B + n) / 8⌉ requests of 8; CTX cached tokens a request, bf16 SmolLM2, 2 threads, each shape
timed right after an untimed step of its own, REPS rounds in turn (reversed every other). One JSON line of medians.
    .venv/bin/python docs/results/suffix/s61/shape/real_vs_profile.py B N1,N2,... REPS [CTX] >> shape.jsonl"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from dspark.models.target.loader import load_target
from dspark.models.target.runner import SeqChunk, TargetRunner

torch.set_num_threads(2)
target = load_target("smollm2-135m-instruct", "cpu", torch.bfloat16)
B, EXTRAS, REPS = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
CTX = int(sys.argv[4]) if len(sys.argv) > 4 else 300
runner = TargetRunner(target.model, max(B, 8), CTX + 20, row_invariant=True)
slots = [runner.cache.allocate() for _ in range(max(B, 8))]
ctx = torch.randint(0, runner.vocab_size, (CTX,), generator=torch.Generator().manual_seed(0)).tolist()
runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])


def chunks(sizes: list[int]) -> list[SeqChunk]:
    return [SeqChunk(slots[i], CTX, ctx[:k], k) for i, k in enumerate(sizes)]


def real(n: int) -> list[SeqChunk]:
    return chunks([1 + n // B + (i < n % B) for i in range(B)])


def prof(n: int) -> list[SeqChunk]:
    t = B + n
    return chunks([8] * (t // 8) + ([t % 8] if t % 8 else []))


shapes = [("real", e, real(e)) for e in EXTRAS] + [("prof", e, prof(e)) for e in EXTRAS]
for _, _, c in shapes:
    runner.forward(c)
ms: dict[str, list[float]] = {f"{k}+{e}": [] for k, e, _ in shapes}
for r in range(REPS):
    for k, e, c in shapes if r % 2 == 0 else shapes[::-1]:
        runner.forward(c)
        t0 = time.perf_counter()
        runner.forward(c)
        ms[f"{k}+{e}"].append((time.perf_counter() - t0) * 1e3)
print(json.dumps({"B": B, "ctx": CTX, "median_ms": {k: round(statistics.median(v), 2) for k, v in ms.items()}}))
