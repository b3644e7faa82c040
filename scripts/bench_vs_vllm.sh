#!/usr/bin/env bash
# bench_vs_vllm.sh -- our serving arms and vLLM CPU side by side, one interleaved sweep per vLLM setting.
#
# Usage: scripts/bench_vs_vllm.sh [OUT_DIR]     (default docs/results/serve/vs_vllm)
#
# DSPARK_BENCH_ALONE=1: the fair form (issue 32): each of our arms is also measured with only itself deployed
# (`--alone`, alone vs interleaved per level in summary.fairness), and vLLM's process tree is paused while our
# arms run (`--peer-pid`, its idle cost measured first).
#
# 1. vLLM with the same two cores as dspark (DSPARK_VLLM_THREADS_BIND=0-1) and the dtype `dtype: auto`
#    picks for our verify engine on this machine; our arms no-spec, colocated, decoupled interleaved with it.
# 2. vLLM's own default (fp32, its thread binding: one compute core on a 2-core machine), peer only.
# Same prompts, output length and levels in both; JSON and plots under OUT_DIR. Our arms' slot KV caches
# hold 1024 positions (prompts here are under ~600 tokens): three engines of 2048 × 32 slots next to
# vLLM's 4 GB KV space went past this 24 GiB machine's memory (Ray's monitor killed a verify replica). Needs
# `scripts/peer_vllm.sh install` once. Stop any other CPU work first (2 cores: it would distort both).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/results/serve/vs_vllm}"
LEVELS="${DSPARK_BENCH_LEVELS:-1,2,4,8,16,32}"
TOKENS="${DSPARK_BENCH_TOKENS:-64}"
PORT=8011
mkdir -p "$OUT"
DTYPE="$(.venv/bin/python -c 'from dspark.config.engine import EngineConfig, resolve_dtype; import torch
print({"bf16": "bfloat16"}.get(resolve_dtype(EngineConfig(dtype="auto")), "float32"))')"

wait_ready() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    sleep 1
  done
  echo "vLLM did not come up on :$PORT" >&2; return 1
}

PID=""
stop_peer() { [[ -z "$PID" ]] || { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; PID=""; }; }
trap stop_peer EXIT

start_peer() {  # $1: tag; the rest: environment for peer_vllm.sh
  local tag="$1"; shift
  env "$@" scripts/peer_vllm.sh serve --port "$PORT" >"$OUT/vllm_$tag.log" 2>&1 &
  PID=$!
  wait_ready
}

lscpu | grep -E 'Model name|Flags' >"$OUT/cpu.txt"

# 1. two cores, our dtype, with our three arms interleaved
start_peer two_cores DSPARK_VLLM_THREADS_BIND=0-1 DSPARK_VLLM_DTYPE="$DTYPE"
.venv/bin/dspark bench serve --arms no-spec,colocated,decoupled --interleave --concurrency "$LEVELS" \
  --max-tokens "$TOKENS" --set dtype=auto --set num_threads=2 --set max_model_len=1024 \
  --peer-url "http://127.0.0.1:$PORT" --peer-model smollm2-135m-instruct \
  ${DSPARK_BENCH_ALONE:+--alone --peer-pid "$PID"} \
  --out "$OUT/bench_serve_vs_vllm_2cores.json" --plot-dir "$OUT/plots_2cores"
stop_peer

# 2. vLLM's default setting, peer only
start_peer default DSPARK_VLLM_DTYPE=float32
.venv/bin/dspark bench serve --arms "" --concurrency "$LEVELS" --max-tokens "$TOKENS" \
  --peer-url "http://127.0.0.1:$PORT" --peer-model smollm2-135m-instruct \
  --out "$OUT/bench_serve_vllm_default.json"
stop_peer
echo "results in $OUT"
