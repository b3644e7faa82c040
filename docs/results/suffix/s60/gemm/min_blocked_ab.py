"""Session 60 (from s58's gemm_ab.py): on the Zen 5, is a whole-K pass at 3-8 rows any faster than the k blocks the
bf16 GEMM takes from 3 rows (`DP_MIN_BLOCKED` 3)? All of SmolLM2's GEMMs of one step in bf16 (every layer's qkv, o,
gate_up, down and the LM head, the `dpbf16` kernel) at 1-8 rows, with a base commit's kernels (`base`, default HEAD),
this checkout's (`head`) and this checkout's with the switch at 5, 7 or 9 rows (`min9`: whole-K up to 8 rows), TURNS
turns, the variants' order reversed every other turn; outputs compared with the base's at every row count
(bit-identical or an error). Median ms per variant and row count, one JSON line.
    .venv/bin/python docs/results/suffix/s60/gemm/min_blocked_ab.py [TURNS] [BASE_COMMIT] > min_blocked_ab.json"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.bench.kernel_ab import kernel_libraries, use_library
from dspark.kernels.machine import cpu_signature

TURNS = int(sys.argv[1]) if len(sys.argv) > 1 else 25
base_commit = sys.argv[2] if len(sys.argv) > 2 else "HEAD"
ROWS = (1, 2, 3, 4, 5, 6, 7, 8)
torch.set_num_threads(2)
libs = kernel_libraries(base_commit, {"min5": {"DP_MIN_BLOCKED": "5"}, "min7": {"DP_MIN_BLOCKED": "7"},
                                      "min9": {"DP_MIN_BLOCKED": "9"}})
use_library(libs, "base")
target, _, _ = mixed_frame(1, 8)
runner = _engine(BASE, target, 4, 1024, "greedy", 7, None, True, {}).runner
gen = torch.Generator().manual_seed(0)
xs = {m: torch.randn(m, runner.layers[0].qkv.weight.shape[1], generator=gen).to(torch.bfloat16) for m in ROWS}
hs = {m: torch.randn(m, runner.layers[0].down.weight.shape[1], generator=gen).to(torch.bfloat16) for m in ROWS}


def gemms(m: int) -> list[torch.Tensor]:
    x, out = xs[m], []
    for layer in runner.layers:
        out += [layer.qkv(x, "dpbf16"), layer.o(x, "dpbf16"), layer.gate_up(x, "dpbf16"), layer.down(hs[m], "dpbf16")]
    return out + [runner.lm_head(x, "dpbf16")]


reference = {m: gemms(m) for m in ROWS}  # the base's
times: dict[str, dict[int, list[float]]] = {v: {m: [] for m in ROWS} for v in libs}
for turn in range(TURNS):
    for variant in (list(libs) if turn % 2 == 0 else list(libs)[::-1]):
        use_library(libs, variant)
        for m in ROWS:
            t0 = time.perf_counter()
            out = gemms(m)
            times[variant][m].append((time.perf_counter() - t0) * 1e3)
            if turn == 0 and not all(torch.equal(a, b) for a, b in zip(out, reference[m])):
                raise RuntimeError(f"{variant} at {m} rows differs from {base_commit}'s kernels")
print(json.dumps({"cpu": cpu_signature(), "base": base_commit, "turns": TURNS, "bit_identical": True,
                  "ms": {v: {m: round(statistics.median(t), 2) for m, t in by.items()} for v, by in times.items()}}))
