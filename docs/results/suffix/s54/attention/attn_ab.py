"""Session 54, measured and not kept (the change: `qk_tile.diff`, the QK scores of up to 4 (query, head) pairs a tile,
their VDPBF16PS chains interleaved): the bf16 native attention (`attention_bf16`) of a base commit against this
checkout's, side by side in one process (`dspark.bench.kernel_ab`). SmolLM2's shape (9 query heads, 3 KV heads,
head_dim 64), 30 layers each with its own K/V caches (32 slots x 512 rows, so a step reads them from memory as a
forward does), 300 cached keys a slot; a "step" is the 30 layers' attention for R requests x L tokens each (token i
of a request sees 300 + i + 1 keys); median of 7 turns of >= 0.3 s, the libraries' outputs compared bit for bit.
2 threads. One JSON line. VARIANTS (optional): more builds of this checkout's source with macros set first,
NAME=MACRO:VALUE,... . attn_ab.json: `git apply qk_tile.diff` on 07cc625, then `attn_ab.py HEAD`.
    .venv/bin/python docs/results/suffix/s54/attention/attn_ab.py [BASE_COMMIT] [R,L;R,L;...] [VARIANTS]"""

from __future__ import annotations

import json
import sys

import torch

from dspark.bench.kernel_ab import kernel_libraries, turns_ms, use_library
from dspark.kernels import native
from dspark.kernels.machine import cpu_signature

torch.set_num_threads(2)
BASE = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
SHAPES = [tuple(int(x) for x in s.split(",")) for s in
          (sys.argv[2] if len(sys.argv) > 2 else "1,1;1,4;1,8;4,3;8,1;8,2;16,1;32,1;32,2").split(";")]
H, KV, HD, LAYERS, SLOTS, MAX_LEN, CTX = 9, 3, 64, 30, 32, 512, 300
defines: dict[str, dict[str, str]] = {}
for spec in (sys.argv[3].split(",") if len(sys.argv) > 3 else []):
    name, macro = spec.split("=")
    key, value = macro.split(":")
    defines.setdefault(name, {})[key] = value
libs = kernel_libraries(BASE, defines)
gen = torch.Generator().manual_seed(0)
caches = [(torch.randn(SLOTS, MAX_LEN, KV, HD, generator=gen).to(torch.bfloat16),
           torch.randn(SLOTS, MAX_LEN, KV, HD, generator=gen).to(torch.bfloat16)) for _ in range(LAYERS)]
result: dict = {"cpu": cpu_signature(), "base": BASE, "shapes": []}
for R, L in SHAPES:
    T = R * L
    qk = torch.randn(T, H + 2 * KV, HD, generator=gen).to(torch.bfloat16)
    key_row = torch.tensor([r * MAX_LEN for r in range(R) for _ in range(L)], dtype=torch.int64)
    num_keys = torch.tensor([CTX + i + 1 for _ in range(R) for i in range(L)], dtype=torch.int64)
    max_keys = CTX + L

    def step(name: str, args: tuple = (qk, key_row, num_keys, max_keys)):  # noqa: ANN202 - a variant for turns_ms
        q, rows, keys, most = args

        def run() -> list[torch.Tensor]:
            use_library(libs, name)
            return [native.attention(q, H, k, v, rows, keys, most, HD ** -0.5) for k, v in caches]
        return run

    outs = {name: step(name)() for name in libs}
    identical = all(torch.equal(a, b) for n in libs for a, b in zip(outs["base"], outs[n]))
    med = turns_ms({name: step(name) for name in libs}, turns=7, min_s=0.3, warmup=1)
    row = {"requests": R, "tokens_each": L, **{f"{n}_ms": round(v, 3) for n, v in med.items()},
           **{f"{n}_over_base": round(med[n] / med["base"], 3) for n in libs if n != "base"},
           "bit_identical": identical}
    result["shapes"].append(row)
    print(row, file=sys.stderr, flush=True)
print(json.dumps(result))
