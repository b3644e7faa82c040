"""Session 49: the native attention kernel of a base commit (default 4cc756b, session 48's) against this checkout's,
side by side in one process: both sources built and loaded as `native.library()` does, taking turns.
Part 1, the kernel alone (bf16 and fp32 caches; 9 query heads over 3 KV heads of 64, SmolLM2's shape): R slots of
Q queries each over `ctx` cached keys, a call on each of 30 caches in turn (as a forward's 30 layers: the caches come
from DRAM, not from the L3 that one cache fits in), median of 7 turns. Part 2, SmolLM2's whole forward
(`TargetRunner`, bf16, 300 cached tokens a slot) at R x L tokens with either library's kernels, 5 turns of 0.6 s,
medians. 2 threads. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s49/kernel/attention_ab.py [BASE_COMMIT]"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark.kernels import native
from dspark.kernels.machine import cpu_signature

torch.set_num_threads(2)
BASE = sys.argv[1] if len(sys.argv) > 1 else "4cc756b"
tmp = Path(tempfile.mkdtemp())
(tmp / "base.c").write_text(subprocess.run(["git", "show", f"{BASE}:dspark/kernels/native_kernels.c"],
                                           capture_output=True, text=True, check=True).stdout)
sources = {"base": tmp / "base.c", "head": native.SOURCE}
libs = {}
for name, src in sources.items():  # the way native.library() loads them, so the runner can take either
    native.SOURCE = Path(src)
    native.library.cache_clear()
    libs[name] = native.library()
native.SOURCE = sources["head"]


def use(name: str) -> None:
    native.library = lambda: libs[name]  # type: ignore[assignment]
    native._required = lambda: libs[name]  # type: ignore[assignment]


H, KV, HD, L = 9, 3, 64, 1024
result: dict = {"cpu": cpu_signature(), "base": BASE, "kernel": [], "forward": []}
for dt in (torch.bfloat16, torch.float32):
    for R, Q, ctx in [(1, 1, 200), (1, 8, 200), (8, 1, 200), (8, 2, 200), (8, 4, 200), (32, 1, 300), (32, 2, 300),
                      (8, 2, 600)]:
        caches = [(torch.randn(R, L, KV, HD).to(dt), torch.randn(R, L, KV, HD).to(dt)) for _ in range(30)]
        T = R * Q
        qk = torch.randn(T, H + 2 * KV, HD).to(dt)
        key_row = torch.tensor([r * L for r in range(R) for _ in range(Q)])
        num_keys = torch.tensor([ctx + q + 1 for r in range(R) for q in range(Q)])
        mk = int(num_keys.max())
        times: dict[str, list[float]] = {"base": [], "head": []}
        for _ in range(7):
            for name in times:
                use(name)
                for kc, vc in caches[:5]:
                    native.attention(qk, H, kc, vc, key_row, num_keys, mk, 0.125)
                t0 = time.perf_counter()
                for _ in range(2):
                    for kc, vc in caches:
                        native.attention(qk, H, kc, vc, key_row, num_keys, mk, 0.125)
                times[name].append((time.perf_counter() - t0) / (2 * len(caches)) * 1e6)
        a, b = statistics.median(times["base"]), statistics.median(times["head"])
        result["kernel"].append({"dtype": str(dt)[6:], "slots": R, "queries": Q, "ctx": ctx, "base_us": round(a, 1),
                                 "head_us": round(b, 1), "head_over_base": round(b / a, 3)})
        print(result["kernel"][-1], file=sys.stderr, flush=True)

from dspark.models.target.layer import SeqChunk  # noqa: E402
from dspark.models.target.loader import load_target  # noqa: E402
from dspark.models.target.runner import TargetRunner  # noqa: E402

use("head")
runner = TargetRunner(load_target(dtype="bf16").model, 32, 1024)
slots = [runner.cache.allocate() for _ in range(32)]
gen = torch.Generator().manual_seed(0)
ctxs = [torch.randint(4, 40000, (300,), generator=gen).tolist() for _ in range(32)]
with torch.inference_mode():
    for s, c in zip(slots, ctxs):
        runner.forward([SeqChunk(s, 0, c, 1)])
    for R, Lq in [(1, 1), (1, 4), (1, 8), (4, 4), (8, 1), (8, 2), (8, 4), (32, 1), (32, 2)]:
        chunks = [SeqChunk(slots[i], 300, ctxs[i][:Lq], Lq) for i in range(R)]
        times = {"base": [], "head": []}
        for _ in range(5):
            for name in times:
                use(name)
                for _ in range(2):
                    runner.forward(chunks)
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < 0.6:
                    runner.forward(chunks)
                    n += 1
                times[name].append((time.perf_counter() - t0) / n * 1e3)
        a, b = statistics.median(times["base"]), statistics.median(times["head"])
        result["forward"].append({"slots": R, "tokens_each": Lq, "base_ms": round(a, 2), "head_ms": round(b, 2),
                                  "head_over_base": round(b / a, 3)})
        print(result["forward"][-1], file=sys.stderr, flush=True)
print(json.dumps(result))
