"""Session 53: the AVX512-BF16 GEMM (`gemm_dpbf16`) of a base commit (default 38ca5fb, before one range of column pairs
a thread) against this checkout's, side by side in one process (`dspark.bench.kernel_ab`: both sources built and
loaded as `native.library()` does, taking turns in alternating order). Part 1, the kernel alone: every GEMM of
SmolLM2's step (its real bf16 weights: 30 layers' q, k, v, o, gate, up, down and the LM head, each packed as the
runner packs it, on huge pages) at M rows, each weight once in turn (as a forward: the weights come from DRAM),
median of 7 turns; outputs compared bit for bit. Part 2, the whole forward (`TargetRunner`, bf16, 300 cached tokens a
slot) at R x L tokens with either library's kernels, 5 turns of 0.6 s, medians. 2 threads. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s53/gemm/gemm_ab.py [BASE_COMMIT] [ROWS,... | none] [--kernel-only]"""

from __future__ import annotations

import json
import sys

import torch

from dspark.bench.kernel_ab import kernel_libraries, turns_ms, use_library
from dspark.kernels import native
from dspark.kernels.machine import cpu_signature
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
BASE = sys.argv[1] if len(sys.argv) > 1 else "38ca5fb"
ROWS = ([int(r) for r in sys.argv[2].split(",") if r != "none"] if len(sys.argv) > 2
        else [1, 4, 8, 10, 12, 16, 20, 24, 32, 48])
SHAPES = [(1, 1), (1, 4), (1, 8), (4, 3), (8, 1), (8, 2), (8, 4), (16, 1), (32, 1), (32, 2)]
libs = kernel_libraries(BASE)
target = load_target(dtype="bf16")
weights = [m.weight.detach() for m in target.model.modules()
           if isinstance(m, torch.nn.Linear) and native._tileable_bf16(m.weight)]
use_library(libs, "head")
packed = [(native.amx_pack(w), w.shape[0], w.shape[1]) for w in weights]
flops_per_row = sum(2 * o * i for _, o, i in packed)
result: dict = {"cpu": cpu_signature(), "base": BASE, "num_weights": len(packed), "kernel": [], "forward": []}


def all_gemms(name: str, xs: dict[int, torch.Tensor]):  # noqa: ANN201 - a variant for turns_ms
    def run() -> None:
        use_library(libs, name)
        for p, o, i in packed:
            native.dpbf16_linear(xs[i], p, o)
    return run


for M in ROWS:
    xs = {i: torch.randn(M, i).to(torch.bfloat16) for i in {i for _, _, i in packed}}
    outs = {}
    for name in libs:
        use_library(libs, name)
        outs[name] = [native.dpbf16_linear(xs[i], p, o) for p, o, i in packed[:8]]
    identical = all(torch.equal(a, b) for n in libs for a, b in zip(outs["base"], outs[n]))
    med = turns_ms({name: all_gemms(name, xs) for name in libs}, turns=7)
    result["kernel"].append({"rows": M, **{f"{n}_ms": round(v, 2) for n, v in med.items()},
                             **{f"{n}_gflop_s": round(flops_per_row * M / v / 1e6, 1) for n, v in med.items()},
                             "head_over_base": round(med["head"] / med["base"], 3), "bit_identical": identical})
    print(result["kernel"][-1], file=sys.stderr, flush=True)

if "--kernel-only" not in sys.argv:
    use_library(libs, "head")
    runner = TargetRunner(target.model, 32, 1024)
    slots = [runner.cache.allocate() for _ in range(32)]
    gen = torch.Generator().manual_seed(0)
    ctxs = [torch.randint(4, 40000, (300,), generator=gen).tolist() for _ in range(32)]

    def forward(name: str, chunks: list[SeqChunk]):  # noqa: ANN202 - a variant for turns_ms
        def run() -> None:
            use_library(libs, name)
            runner.forward(chunks)
        return run

    with torch.inference_mode():
        for s, c in zip(slots, ctxs):
            runner.forward([SeqChunk(s, 0, c, 1)])
        for R, Lq in SHAPES:
            chunks = [SeqChunk(slots[i], 300, ctxs[i][:Lq], Lq) for i in range(R)]
            med = turns_ms({name: forward(name, chunks) for name in ("base", "head")}, turns=5, min_s=0.6, warmup=2)
            result["forward"].append({"slots": R, "tokens_each": Lq, "base_ms": round(med["base"], 2),
                                      "head_ms": round(med["head"], 2),
                                      "head_over_base": round(med["head"] / med["base"], 3)})
            print(result["forward"][-1], file=sys.stderr, flush=True)
print(json.dumps(result))
