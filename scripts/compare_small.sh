#!/usr/bin/env bash
# Issue 4's side-by-side of the four drafters on the small comparison budget (configs/train/small/*.yaml,
# trained first: `dspark train --config configs/train/small/<name>.yaml` for dspark, dflash, eagle3, mtp1):
#   1. `dspark eval` of each at T=1 and T=0 (10 prompts per shared set, 64 tokens), then `dspark compare`
#      (τ table + Fig. 2 per temperature);
#   2. `dspark bench decode` of all drafters with a fixed K=7 block at batch 1 and 8, side by side with target-only;
#   3. STS on vs off end to end: the shipped DSpark checkpoint with and without its STS temperatures
#      (`dspark-nosts`) under Algorithm 1, with the draft gate and without it.
# Resumable: an output that exists is skipped. Outputs under $DSPARK_COMPARE (default ~/.cache/dspark/compare/after).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
CKPT=${DSPARK_COMPARE_CKPT:-$HOME/.cache/dspark/compare}
OUT=${DSPARK_COMPARE:-$CKPT/after}
mkdir -p "$OUT"
step() {  # step NAME OUTPUT COMMAND...: run COMMAND unless OUTPUT exists, log to $OUT/NAME.log
  local name=$1 out=$2; shift 2
  [ -f "$out" ] && { echo "$name: $out exists, skipped"; return; }
  local s; s=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - s )) s"
}
for n in dspark dflash eagle3 mtp1; do
  step "eval_$n" "$OUT/eval/$n/eval_$n.json" .venv/bin/dspark eval --drafter $n --checkpoint "$CKPT/$n-smollm2" \
    --num-prompts 10 --max-new-tokens 64 --temperature 1 --temperature 0 --num-threads 2 --out-dir "$OUT/eval/$n"
done
for T in 1.0 0.0; do
  .venv/bin/dspark compare "$OUT"/eval/{dspark,dflash,eagle3,mtp1}/eval_*.json --temperature $T \
    --out "$OUT/four_drafters_T${T%.0}.png" | tail -1 > "$OUT/four_drafters_T${T%.0}.json"
done
step bench_decode_fixed "$OUT/bench_decode_fixed.json" .venv/bin/dspark bench decode \
  --drafters ngram,dspark,dflash,eagle3,mtp1 --checkpoint "dspark=$CKPT/dspark-smollm2" \
  --checkpoint "dflash=$CKPT/dflash-smollm2" --checkpoint "eagle3=$CKPT/eagle3-smollm2" \
  --checkpoint "mtp1=$CKPT/mtp1-smollm2" --batch-sizes 1,8 --num-prompts 4 --max-new-tokens 64 \
  --scheduler fixed --hf-dtypes "" --num-threads 2 --out "$OUT/bench_decode_fixed.json"
step bench_decode_sts "$OUT/bench_decode_sts.json" .venv/bin/dspark bench decode --drafters dspark,dspark-nosts \
  --batch-sizes 1,8 --num-prompts 4 --max-new-tokens 64 --scheduler greedy --hf-dtypes "" --num-threads 2 \
  --out "$OUT/bench_decode_sts.json"
step bench_decode_sts_nogate "$OUT/bench_decode_sts_nogate.json" .venv/bin/dspark bench decode \
  --drafters dspark,dspark-nosts --batch-sizes 1,8 --num-prompts 4 --max-new-tokens 64 --scheduler greedy \
  --no-draft-gate --hf-dtypes "" --num-threads 2 --out "$OUT/bench_decode_sts_nogate.json"
echo "compare_small done: $OUT"
