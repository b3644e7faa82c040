"""Session 53: the hybrid's γ (the longest draft it may propose) where the step curve is flat, side by side in one
process: target-only and hybrid engines (Algorithm 1, the draft gate on, the shipped step curve) differing only in
γ, the arms in turn on each of NUM mixed prompts (`run_interleaved`), ROUNDS rounds, at batch 1; greedy, 128
tokens, every arm's output checked against target-only's. Prints one JSON line: per γ the speedup over target-only
(and per domain), τ and tokens verified a step.
    .venv/bin/python docs/results/suffix/s53/sps/gamma_ab.py [G,...] [NUM] [ROUNDS] > gamma_ab.json"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import BASE, _engine, mixed_frame, run_interleaved
from dspark.kernels.machine import cpu_signature

gammas = [int(g) for g in (sys.argv[1] if len(sys.argv) > 1 else "7,10,12,15").split(",")]
num = int(sys.argv[2]) if len(sys.argv) > 2 else 24
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
target, labelled, max_len = mixed_frame(num, 128)
max_len += max(gammas)
prompts = [p for _, p in labelled]
engines = {BASE: _engine(BASE, target, 1, max_len, "greedy", 7, None, True, {})}
for g in gammas:
    engines[f"g{g}"] = _engine("hybrid", target, 1, max_len, "greedy", g, None, True, {})
arms = run_interleaved(engines, prompts, 128, rounds)
base = arms[BASE]
out: dict = {"cpu": cpu_signature(), "num_prompts": num, "rounds": rounds, "target_only_tok_s": round(base.tok_s, 1)}
for g in gammas:
    arm = arms[f"g{g}"]
    by_domain: dict[str, list[float]] = {}
    for (domain, _), b, a in zip(labelled, base.group_s, arm.group_s):
        acc = by_domain.setdefault(domain, [0.0, 0.0])
        acc[0], acc[1] = acc[0] + b, acc[1] + a
    out[f"g{g}"] = {"speedup": round(arm.tok_s / base.tok_s, 3), "tau": round(arm.tau, 3),
                    "verify_len": round(arm.mean_verify_len, 3),
                    "by_domain": {d: round(b / a, 3) for d, (b, a) in by_domain.items()},
                    "greedy_identical": arm.outputs == base.outputs}
print(json.dumps(out))
