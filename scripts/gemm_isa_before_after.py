"""The native fp32 GEMM (`gemm_blocked_f32`) of two commits, built for this CPU and for an AVX2-only one
(`-march=x86-64-v3`), on the target's layer shapes, interleaved in one run: GFLOP/s per row count, the median
of the repeats, and after / before per ISA. JSON last.

    python scripts/gemm_isa_before_after.py --before a9adf08 --rows 1,4,8,32,128 --repeats 5

The kernels are compiled from `git show <commit>:<path>` (the file moved from dspark/models/ to dspark/kernels/)
with the flags `dspark/kernels/native.py` uses; the weights are packed as each build asks (its tile width).
On an AVX-512 machine the x86-64-v3 builds are the code an AVX2-only CPU runs, timed on this CPU's cores.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("dspark/kernels/native_kernels.c", "dspark/models/native_kernels.c")
FLAGS = ["-O3", "-fopenmp", "-funroll-loops", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c11"]
MARCH = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3", "-mtune=native"]}


def _source(commit: str) -> str:
    for path in PATHS:
        res = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if res.returncode == 0:
            return res.stdout
    raise SystemExit(f"no native_kernels.c at {commit}")


def _build(source: str, isa: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["cc", *FLAGS, *MARCH[isa], str(src), "-o", str(out), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    lib.native_tile_outputs.restype = ctypes.c_int64
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.gemm_blocked_f32.argtypes = [p, p, p, i, i, i, i]
    return lib


def _gflop_s(lib: ctypes.CDLL, shapes: list[tuple[int, int]], rows: int, layers: int, threads: int) -> float:
    """One step's layer GEMMs (`layers` times the shapes) at `rows` rows: GFLOP/s of the median of 3 calls."""
    width = lib.native_tile_outputs()
    rng = np.random.default_rng(0)
    work = []
    for d_in, d_out in shapes:
        pad = -(-d_out // width) * width
        work.append((rng.standard_normal((rows, d_in), dtype=np.float32),
                     rng.standard_normal((pad // 16, d_in, 16), dtype=np.float32),
                     np.zeros((rows, d_out), dtype=np.float32), d_in, d_out))

    def step() -> None:
        for _ in range(layers):
            for x, wp, y, d_in, d_out in work:
                lib.gemm_blocked_f32(x.ctypes.data, wp.ctypes.data, y.ctypes.data, rows, d_in, d_out, threads)

    step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    flops = 2 * rows * layers * sum(a * b for a, b in shapes)
    return flops / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--rows", default="1,4,8,32,128")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    # SmolLM2-135M: hidden 576, 9 heads + 2 * 3 KV heads of 64, MLP 1536, 30 layers
    ap.add_argument("--shapes", default="576x960,576x576,576x3072,1536x576", help="in x out of each layer GEMM")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    tmp = Path(tempfile.mkdtemp())
    libs = {(commit, isa): _build(_source(commit), isa, tmp / f"{i}-{isa}.so")
            for i, commit in enumerate((args.before, args.after)) for isa in MARCH}
    samples: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):  # interleaved: before and after alternate within every repeat
        for r in rows:
            for key, lib in libs.items():
                samples.setdefault((*key, r), []).append(_gflop_s(lib, shapes, r, args.layers, args.threads))
    out: dict = {"cpu": subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True,
                                       text=True).stdout.split(":", 1)[-1].strip(),
                 "before": args.before, "after": args.after, "threads": args.threads, "shapes": args.shapes,
                 "gflop_s": {}, "after_over_before": {}}
    for isa in MARCH:
        for r in rows:
            b = statistics.median(samples[(args.before, isa, r)])
            a = statistics.median(samples[(args.after, isa, r)])
            out["gflop_s"].setdefault(isa, {})[r] = {"before": round(b, 1), "after": round(a, 1),
                                                     "spread_before": round(max(samples[(args.before, isa, r)])
                                                                            - min(samples[(args.before, isa, r)]), 1),
                                                     "spread_after": round(max(samples[(args.after, isa, r)])
                                                                           - min(samples[(args.after, isa, r)]), 1)}
            out["after_over_before"].setdefault(isa, {})[r] = round(a / b, 2)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
