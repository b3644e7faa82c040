#!/usr/bin/env bash
# Issue 28's speed figures in one go, each a side-by-side run on this machine (nothing else should run):
#   1. `dspark bench decode`: the hybrid against the suffix sources alone, prompt lookup, DSpark and the
#      oracle, at batch 1 and 8, every drafter under Algorithm 1 (greedy scheduler), per domain; at batch 1
#      the arms take turns prompt by prompt over NUM_PROMPTS (default 8: 2 math, 4 code, 2 chat; 24 gives 6
#      chat prompts where 2 are a thin sample), ROUNDS (default 2) times over the prompts; at batch 8 (32
#      prompts through 8 slots) they take turns run by run, ROUNDS runs each;
#   2. `dspark bench serve --interleave`: no-spec, the hybrid under Algorithm 1 ("scheduled") and MTP-1 over
#      HTTP, C = LEVELS (default 1..32), 128 tokens, PASSES (default 2) interleaved passes per level, WAVES
#      (default 2) waves of C requests per level and pass, so a level
#      measures continuous batching and not only the drain of one batch of C requests (ARM_CONFIG=
#      configs/bench/suffix_arm.yaml adds the training-free sources alone as the arm "suffix"; ARM_THREADS,
#      default 2: torch threads per arm, the arms taking turns on the cores; MAX_MODEL_LEN, default 1024: the
#      prompts (<= 2,000 characters) and 128 tokens fit, and each arm's KV cache, allocated for 32 such
#      sequences, takes half what it does at 2048: three arms and a vLLM peer overran 24 GiB at C = 32 in s37,
#      Ray's OOM killer took a replica and its requests failed). PEER_URL and
#      PEER_PID: a running OpenAI-compatible server (scripts/peer_vllm.sh serve) as the arm "peer", asked for
#      PEER_MODEL (default smollm2-135m-instruct, the name peer_vllm.sh serves).
# The verify dtype is this machine's measured choice for verification (`dtype: auto` in serve.yaml: bf16 on
# CPUs with AMX / AVX-512-BF16, fp32 elsewhere), so the figures are those `make serve` would see.
#   scripts/bench_suffix.sh OUT_DIR [decode|serve|all]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/suffix}
WHAT=${2:-all}
mkdir -p "$OUT"
DTYPE=$(.venv/bin/python - <<'EOF'
from dspark.models.target.dtype_choice import chosen_dtype
from dspark.kernels.cache_once import cache_dir
from dspark.models.target.profiles import recorded_dtype_choice
print(chosen_dtype("verify", "smollm2-135m-instruct", "cpu", cache_dir(),
                   recorded_dtype_choice("smollm2-135m-instruct", "cpu")) or "fp32")
EOF
)
echo "verify dtype: $DTYPE" >&2
if [ "$WHAT" = decode ] || [ "$WHAT" = all ]; then
  .venv/bin/dspark bench decode --drafters hybrid,suffix,ngram,dspark,oracle --batch-sizes 1,8 \
    --scheduler greedy --num-prompts "${NUM_PROMPTS:-8}" --rounds "${ROUNDS:-2}" --max-new-tokens 128 --dtype "$DTYPE" --hf-dtypes "" \
    --out "$OUT/bench_decode.json"
fi
if [ "$WHAT" = serve ] || [ "$WHAT" = all ]; then
  .venv/bin/dspark bench serve --interleave --arms no-spec,scheduled,mtp1 --drafter hybrid --max-tokens 128 \
    --arm-config "${ARM_CONFIG:-configs/bench/hybrid_arm.yaml}" --concurrency "${LEVELS:-1,2,4,8,16,32}" --waves "${WAVES:-2}" --passes "${PASSES:-2}" --set "dtype=$DTYPE" \
    --set "num_threads=${ARM_THREADS:-2}" --set "max_model_len=${MAX_MODEL_LEN:-1024}" \
    ${PEER_URL:+--peer-url "$PEER_URL" --peer-model "${PEER_MODEL:-smollm2-135m-instruct}"} \
    ${PEER_PID:+--peer-pid "$PEER_PID"} \
    --out "$OUT/bench_serve.json" --plot-dir "$OUT"
fi
