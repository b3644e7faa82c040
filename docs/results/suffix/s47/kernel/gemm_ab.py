"""Session 47: SmolLM2-135M's decoder-layer GEMMs (30 layers of qkv 960x576, o 576x576, gate|up 3072x576,
down 576x1536, each layer its own weights, so the weights stream from memory as in a forward) and the LM head
(49152x576), per row count, 2 threads, with each kernel the GEMM plan can pick on a CPU with AVX512-BF16 and no
AMX: the native bf16 kernel on VDPBF16PS (`dpbf16`), F.linear in bf16 (oneDNN), the native fp32 kernel. Kernels
take turns, 3 rounds, best of each; prints one JSON line.
    .venv/bin/python docs/results/suffix/s47/kernel/gemm_ab.py"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

from dspark.kernels import native
from dspark.kernels.machine import cpu_signature

torch.set_num_threads(2)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
gen = torch.Generator().manual_seed(0)
weights = [[(torch.randn(n, k, generator=gen) * 0.05) for n, k in SHAPES] for _ in range(30)]
head = torch.randn(49152, 576, generator=gen) * 0.05
bf16 = [[w.to(torch.bfloat16) for w in layer] for layer in weights]
dp = [[native.amx_pack(w) for w in layer] for layer in bf16]
f32 = [[native.pack(w) for w in layer] for layer in weights]
head_bf16 = head.to(torch.bfloat16)
head_dp, head_f32 = native.amx_pack(head_bf16), native.pack(head)


def layers_fn(kernel: str, x16: dict, x32: dict):
    def run() -> None:
        for i in range(30):
            for j, (n, k) in enumerate(SHAPES):
                if kernel == "dpbf16":
                    native.dpbf16_linear(x16[k], dp[i][j], n)
                elif kernel == "linear_bf16":
                    F.linear(x16[k], bf16[i][j])
                else:
                    native.linear(x32[k], f32[i][j], n)
    return run


def head_fn(kernel: str, x16: dict, x32: dict):
    return {"dpbf16": lambda: native.dpbf16_linear(x16[576], head_dp, 49152),
            "linear_bf16": lambda: F.linear(x16[576], head_bf16),
            "native_fp32": lambda: native.linear(x32[576], head_f32, 49152)}[kernel]


def ms(fn, min_s: float = 0.4) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


out: dict = {"cpu": cpu_signature(), "threads": 2, "ms": {}}
for rows in (1, 4, 8, 16, 32, 64):
    x32 = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
    x16 = {k: v.to(torch.bfloat16) for k, v in x32.items()}
    best: dict[str, float] = {}
    for _ in range(3):
        for kernel in ("dpbf16", "linear_bf16", "native_fp32"):
            for part, make in (("layers", layers_fn), ("head", head_fn)):
                key = f"{part}/{kernel}"
                best[key] = min(best.get(key, float("inf")), ms(make(kernel, x16, x32)))
    out["ms"][rows] = {k: round(v, 2) for k, v in best.items()}
print(json.dumps(out))
