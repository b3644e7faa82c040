#!/usr/bin/env bash
# roofline_isa.sh -- `dspark bench roofline --dtypes fp32` on this CPU as it is, and the same CPU run as an
# AVX2-only one (DSPARK_CPU_ISA=avx2: native kernels built for x86-64-v3; ATEN_CPU_CAPABILITY=avx2,
# ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2: PyTorch's, oneDNN's and MKL's kernels limited to
# AVX2), one after the other. On an
# AVX-512 machine this measures the AVX2 code paths (registers, tiles) where no AVX2-only CPU is at hand;
# the figures are indicative of an AVX2 EPYC's fractions, not its speeds.
#
# Usage: scripts/roofline_isa.sh [OUT_DIR] (default docs/results/engine/roofline_isa); prints one JSON line.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/results/engine/roofline_isa}"
BATCHES="${DSPARK_BENCH_BATCHES:-1,8,32,128,256}"
DSPARK="${DSPARK:-.venv/bin/dspark}"
PY="${PY_BIN:-.venv/bin/python}"
mkdir -p "$OUT"
lscpu | grep -E 'Model name|Flags' >"$OUT/cpu.txt"
"$DSPARK" bench roofline --dtypes fp32 --batch-sizes "$BATCHES" --out "$OUT/native.json" >/dev/null
DSPARK_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
  "$DSPARK" bench roofline --dtypes fp32 --batch-sizes "$BATCHES" --out "$OUT/avx2.json" >/dev/null
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {"cpu": (out / "cpu.txt").read_text().splitlines()[0].split(":", 1)[1].strip()}
for isa in ("native", "avx2"):
    r = json.loads((out / f"{isa}.json").read_text())
    fp32 = r["by_dtype"]["fp32"]
    res[isa] = {"signature": r["cpu"], "wall_s": r["wall_s"],
                "batch1_over_memory_floor": fp32["batch1_over_memory_floor"],
                "decode_tok_s": {b: d["tok_s"] for b, d in fp32["decode"].items()},
                "fraction_of_roofline": {b: d["fraction_of_roofline"] for b, d in fp32["decode"].items()},
                "gemm_roofline_gflop_s": {r_: v["gflop_s"] for r_, v in fp32["gemm_roofline"].items()},
                "gemm_kernel": {r_: v["kernel"] for r_, v in fp32["gemm_roofline"].items()}}
(out / "summary.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res))
PY
