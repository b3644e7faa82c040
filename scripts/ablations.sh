#!/usr/bin/env bash
# Issue 4 ablations on the small comparison budget (configs/train/small/*, 300 steps on the same data):
# γ sweep {4, 8, 12, 16} for DSpark and DFlash, DSpark depth 1 vs 2, Markov vs RNN head. Each run trains
# (configs/train/ablations/<name>.yaml; the synth/vocab/cache stages are shared and skipped) and is then
# evaluated with `dspark eval` at T=1 on the shared sets. Resumable: a trained run or an existing eval JSON is
# skipped, so rerunning after an interruption picks up where it stopped.
# Needs the small comparison's data: `dspark train --config configs/train/small/dspark.yaml` (and dflash.yaml
# for the γ=7 DFlash point) first.
# Usage: scripts/ablations.sh [RUN ...]   (default: all; the reference γ=7 runs are named dspark_g7, dflash_g7)
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
ROOT=${DSPARK_ABLATIONS:-$HOME/.cache/dspark/compare/ablations}
EVAL_ARGS=(--temperature 1.0 --num-prompts 8 --max-new-tokens 64 --num-threads 2)
RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=(dspark_g7 dflash_g7 dspark_g4 dflash_g4 dspark_g12 dflash_g12 dspark_depth1 dspark_rnn
                               dspark_g16 dflash_g16 dspark_g8 dflash_g8)
mkdir -p "$ROOT/logs"
for run in "${RUNS[@]}"; do
  kind=${run%%_*}
  if [ "$run" = "${kind}_g7" ]; then  # the reference point: the small comparison's own checkpoint
    ckpt=$HOME/.cache/dspark/compare/$kind-smollm2
  else
    ckpt=$ROOT/$run
    if [ ! -f "$ckpt/config.json" ]; then
      s=$(date +%s)
      .venv/bin/dspark train --config "configs/train/ablations/$run.yaml" --stages synth,vocab,cache,train,export \
        > "$ROOT/logs/train_$run.log" 2>&1 || { echo "train $run FAILED (see $ROOT/logs/train_$run.log)"; continue; }
      echo "train $run $(( $(date +%s) - s )) s"
    fi
  fi
  if [ ! -f "$ROOT/eval/$run/eval_$run.json" ]; then
    s=$(date +%s)
    .venv/bin/dspark eval --drafter "$kind" --checkpoint "$ckpt" --label "$run" "${EVAL_ARGS[@]}" \
      --out-dir "$ROOT/eval/$run" > "$ROOT/logs/eval_$run.log" 2>&1 \
      || { echo "eval $run FAILED (see $ROOT/logs/eval_$run.log)"; continue; }
    echo "eval $run $(( $(date +%s) - s )) s"
  fi
done
echo "ablations done"
