#!/usr/bin/env bash
# bench_serving_path.sh -- what the serving path costs: over HTTP at C = 1 (no-spec arm, Serve pools behind
# the front door) against the in-process engine's batch-1 target-only decode, same target, dtype, threads and
# output length, in one run; and the cores the idle arm keeps busy (replicas, heartbeats, metrics).
#
# Usage: scripts/bench_serving_path.sh [OUT_DIR]    (default docs/results/serve/serving_path)
# Prints one JSON line: in-process tok/s, HTTP tok/s and TPS/user at C = 1, their ratio, the idle cores.
# Stop any other CPU work first (pause your own long jobs with SIGSTOP): two cores are easily shared.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/results/serve/serving_path}"
TOKENS="${DSPARK_BENCH_TOKENS:-128}"
THREADS="${DSPARK_BENCH_THREADS:-2}"
TARGET="${DSPARK_BENCH_TARGET:-smollm2-135m-instruct}"
mkdir -p "$OUT"
DSPARK="${DSPARK:-.venv/bin/dspark}"
PY="${PY_BIN:-.venv/bin/python}"
DTYPE="$($PY -c 'from dspark.config.engine import EngineConfig, resolve_dtype
print(resolve_dtype(EngineConfig(dtype="auto")))')"
lscpu | grep -E 'Model name|Flags' >"$OUT/cpu.txt"

"$DSPARK" bench decode --target "$TARGET" --drafters none --batch-sizes 1 --num-prompts 4 --max-new-tokens "$TOKENS" \
  --hf-dtypes '' --dtype "$DTYPE" --num-threads "$THREADS" --out "$OUT/in_process.json" >/dev/null
# --interleave with one arm: the idle probe runs (cores used with no load) and the arm is measured in passes
"$DSPARK" bench serve --target "$TARGET" --arms no-spec --interleave --alone --concurrency 1 --max-tokens "$TOKENS" \
  --num-requests 8 --set dtype="$DTYPE" --set num_threads="$THREADS" --out "$OUT/http.json" >/dev/null
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
dec = json.loads((out / "in_process.json").read_text())
srv = json.loads((out / "http.json").read_text())
inter = srv["arms"]["no-spec"]["levels"][0]
alone = srv["arms"]["no-spec"]["alone_levels"][0]
in_proc = dec["batch1"]["target_only_tok_s"]
res = {"cpu": (out / "cpu.txt").read_text().splitlines()[0].split(":", 1)[1].strip(), "dtype": dec["dtype"],
       "in_process_batch1_tok_s": round(in_proc, 1),
       "http_c1_tok_s": round(alone["output_throughput_tok_s"], 1),
       "http_c1_tps_user_median": round(alone["tps_user_median"], 1),
       "http_c1_ttft_p50_s": round(alone["ttft_p50_s"], 3),
       "http_c1_tps_user_over_in_process": round(alone["tps_user_median"] / in_proc, 3),
       "http_c1_pass_tok_s": inter["pass_throughput_tok_s"],
       "idle_cores_by_group": srv["idle_cores"]}
(out / "summary.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res))
PY
