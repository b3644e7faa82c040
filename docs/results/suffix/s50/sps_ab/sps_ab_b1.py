"""Session 50: at batch 1, the shipped Zen 4 bf16 profile (session 47's) against the one measured with this session's
kernels (`../profile/s50_profile_bf16_median.json`: the median of 3 runs; 8 tokens a step 16.9 ms where session 47's
read 19.3), side by side: target-only and two hybrid engines differing only in their table, the arms in turn on each
prompt (`run_interleaved`), ROUNDS rounds over NUM mixed prompts; greedy, 128 tokens. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s50/sps_ab/sps_ab_b1.py [NUM] [ROUNDS]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.bench.decode import BASE, _engine, mixed_frame, run_interleaved
from dspark.kernels.machine import cpu_signature
from dspark.spec.sps import SPSTable

num = int(sys.argv[1]) if len(sys.argv) > 1 else 24
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
new = SPSTable.from_file(Path(__file__).parent.parent / "profile" / "s50_profile_bf16_median.json").monotone()
target, labelled, max_len = mixed_frame(num, 128)
prompts = [p for _, p in labelled]
engines = {BASE: _engine(BASE, target, 1, max_len, "greedy", 7, None, True, {}),
           "s47": _engine("hybrid", target, 1, max_len, "greedy", 7, None, True, {}),
           "new": _engine("hybrid", target, 1, max_len, "greedy", 7, None, True, {})}
engines["new"].sps = new
assert engines["s47"].sps.step_time_ms != new.step_time_ms
arms = run_interleaved(engines, prompts, 128, rounds)
base = arms[BASE]
out: dict = {"cpu": cpu_signature(), "num_prompts": num, "rounds": rounds, "target_only_tok_s": round(base.tok_s, 1)}
for arm in ("s47", "new"):
    by_domain: dict[str, list[float]] = {}
    for (domain, _), b, a in zip(labelled, base.group_s, arms[arm].group_s):
        by_domain.setdefault(domain, [0.0, 0.0])
        by_domain[domain][0] += b
        by_domain[domain][1] += a
    out[arm] = {"speedup": round(arms[arm].tok_s / base.tok_s, 3), "tau": round(arms[arm].tau, 3),
                "verify_len": round(arms[arm].mean_verify_len, 3),
                "by_domain": {d: round(b / a, 3) for d, (b, a) in by_domain.items()},
                "greedy_identical": arms[arm].outputs == base.outputs}
print(json.dumps(out))
