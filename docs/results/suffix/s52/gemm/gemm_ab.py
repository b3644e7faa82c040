"""Session 52 (a copy of session 50's script): the AVX512-BF16 GEMM (`gemm_dpbf16`) of a base commit (default 19fcb99,
before the spread prefetch) against this checkout's, side by side in one process: both sources built and loaded as
`native.library()` does, taking turns. Part 1, the kernel alone: every GEMM of SmolLM2's step (its real bf16
weights: 30 layers' q, k, v, o, gate, up, down and the LM head, each packed as the runner packs it, on huge pages)
at M rows, each weight once in turn (as a forward: the weights come from DRAM), median of 7 turns; outputs compared
bit for bit. Part 2, the whole forward (`TargetRunner`, bf16, 300 cached tokens a slot) at R x L tokens with either
library's kernels, 5 turns of 0.6 s, medians. 2 threads. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s52/gemm/gemm_ab.py [BASE_COMMIT] [ROWS,... | none] [--kernel-only]"""

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
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
BASE = sys.argv[1] if len(sys.argv) > 1 else "19fcb99"
ROWS = ([int(r) for r in sys.argv[2].split(",") if r != "none"] if len(sys.argv) > 2
        else [1, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128])
tmp = Path(tempfile.mkdtemp())
(tmp / "base.c").write_text(subprocess.run(["git", "show", f"{BASE}:dspark/kernels/native_kernels.c"],
                                           capture_output=True, text=True, check=True).stdout)
sources = {"base": tmp / "base.c", "head": native.SOURCE}
for spec in [a for a in sys.argv[3:] if ":" in a]:  # name:DEFINE=V,DEFINE=V: the head source with these defines
    vname, defs = spec.split(":", 1)
    text = "".join(f"#define {d.split('=')[0]} {d.split('=')[1]}\n" for d in defs.split(",") if d)
    (tmp / f"{vname}.c").write_text(text + native.SOURCE.read_text())
    sources[vname] = tmp / f"{vname}.c"
libs = {}
for name, src in sources.items():  # the way native.library() loads them, so the runner can take either
    native.SOURCE = Path(src)
    native.library.cache_clear()
    libs[name] = native.library()
native.SOURCE = sources["head"]


def use(name: str) -> None:
    native.library = lambda: libs[name]  # type: ignore[assignment]
    native._required = lambda: libs[name]  # type: ignore[assignment]


target = load_target(dtype="bf16")
weights = [m.weight.detach() for m in target.model.modules()
           if isinstance(m, torch.nn.Linear) and native._tileable_bf16(m.weight)]
use("head")
packed = [(native.amx_pack(w), w.shape[0], w.shape[1]) for w in weights]
flops_per_row = sum(2 * o * i for _, o, i in packed)
result: dict = {"cpu": cpu_signature(), "base": BASE, "num_weights": len(packed), "kernel": [], "forward": []}
for M in ROWS:
    xs = {i: torch.randn(M, i).to(torch.bfloat16) for i in {i for _, _, i in packed}}
    outs = {}
    for name in libs:
        use(name)
        outs[name] = [native.dpbf16_linear(xs[i], p, o) for p, o, i in packed[:8]]
    identical = all(torch.equal(a, b) for n in libs for a, b in zip(outs["base"], outs[n]))
    times: dict[str, list[float]] = {n: [] for n in libs}
    for turn in range(7):
        for name in (list(times) if turn % 2 == 0 else list(times)[::-1]):
            use(name)
            t0 = time.perf_counter()
            for p, o, i in packed:
                native.dpbf16_linear(xs[i], p, o)
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    result["kernel"].append({"rows": M, **{f"{n}_ms": round(v, 2) for n, v in med.items()},
                             **{f"{n}_gflop_s": round(flops_per_row * M / v / 1e6, 1) for n, v in med.items()},
                             **{f"{n}_over_base": round(v / med["base"], 3) for n, v in med.items() if n != "base"},
                             "bit_identical": identical})
    print(result["kernel"][-1], file=sys.stderr, flush=True)

if "--kernel-only" not in sys.argv:
    use("head")
    runner = TargetRunner(target.model, 32, 1024)
    slots = [runner.cache.allocate() for _ in range(32)]
    gen = torch.Generator().manual_seed(0)
    ctxs = [torch.randint(4, 40000, (300,), generator=gen).tolist() for _ in range(32)]
    with torch.inference_mode():
        for s, c in zip(slots, ctxs):
            runner.forward([SeqChunk(s, 0, c, 1)])
        for R, Lq in [(1, 1), (1, 4), (1, 8), (4, 3), (8, 1), (8, 2), (8, 4), (16, 1), (32, 1), (32, 2)]:
            chunks = [SeqChunk(slots[i], 300, ctxs[i][:Lq], Lq) for i in range(R)]
            times = {"base": [], "head": []}
            for turn in range(5):
                for name in (list(times) if turn % 2 == 0 else list(times)[::-1]):
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
