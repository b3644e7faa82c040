"""Session 50: the live survival shift's learning rate (SuffixConfig.live_bias_rate, shipped 0.005) against faster ones,
side by side in one process. Target-only and hybrid engines (Algorithm 1, the draft gate on, the shipped profile)
differing only in η. At batch B, WAVES x B prompts through B slots (continuous batching), the arms in turn (order
rotated), ROUNDS rounds (each engine keeps what it learnt across rounds, as a serving replica does); greedy, 128
tokens. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s50/bias_rate/bias_rate_ab.py [BATCH,...] [ROUNDS] [RATE,...]"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import BASE, _engine, mixed_frame, run_refilled_in_turn
from dspark.kernels.machine import cpu_signature

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "4,8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
rates = [float(r) for r in (sys.argv[3] if len(sys.argv) > 3 else "0.005,0.02,0.05").split(",")]
waves, max_new = 4, 128
target, labelled, max_len = mixed_frame(max(batches) * waves, max_new)
prompts = [p for _, p in labelled]
out: dict = {"cpu": cpu_signature(), "waves": waves, "rounds": rounds, "by_batch": {}}
for bs in batches:
    engines = {BASE: _engine(BASE, target, bs, max_len, "greedy", 7, None, True, {})}
    for rate in rates:
        engine = engines[f"eta={rate}"] = _engine("hybrid", target, bs, max_len, "greedy", 7, None, True, {})
        engine.drafter.suffix.config.live_bias_rate = rate
    arms, by_round = run_refilled_in_turn(engines, prompts[:bs * waves], bs, max_new, rounds)
    base = arms[BASE]
    out["by_batch"][bs] = {"target_only_tok_s": round(base.tok_s, 1), **{
        arm: {"speedup": round(arms[arm].tok_s / base.tok_s, 3),
              "by_round": [round(a / b, 3) for a, b in zip(by_round[arm], by_round[BASE])],
              "tau": round(arms[arm].tau, 3), "verify_len": round(arms[arm].mean_verify_len, 3),
              "bias": {f"{s}/{r}": [round(b, 3) for b in v]
                       for (s, r), v in engines[arm].drafter.suffix.calibration.bias.items()},
              "greedy_identical": arms[arm].outputs == base.outputs} for arm in engines if arm != BASE}}
    print(json.dumps(out["by_batch"][bs]), file=sys.stderr, flush=True)
print(json.dumps(out))
