"""Session 53: the Zen 4 EPYC's bf16 step curve measured again with this session's kernels, and a longer draft where the
curve is flat, side by side in one process. Target-only and hybrid engines (Algorithm 1, the draft gate on) differing
only in the step-time table they schedule on and in γ: `shipped` (session 47's table, shipped until 7069d7a:
../../s50/sps_ab/s47_profile_bf16.json, γ 7), `new` (the median of the `dspark profile` runs in ../profile, γ 7) and
`new-gG` (that table, γ G, for each G given). Batch 1: NUM mixed prompts, the arms in turn on each prompt
(`run_interleaved`), ROUNDS rounds; batch B > 1: WAVES x B prompts through B slots, arm by arm in turn
(`run_refilled_in_turn`), ROUNDS rounds. Greedy, 128 tokens; every arm's output checked against target-only's. Prints
one JSON line: per batch and arm the speedup over target-only (at batch 1 per domain, at B > 1 per round and in the
steady state), τ and tokens verified a request.
    .venv/bin/python docs/results/suffix/s53/sps/sps_ab.py [BATCH,...] [ROUNDS] [G,...] > sps_ab.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.bench.decode import BASE, _engine, arms_vs_target, mixed_frame, run_at
from dspark.kernels.machine import cpu_signature
from dspark.spec.sps import SPSTable

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,4,8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
gammas = [int(g) for g in (sys.argv[3] if len(sys.argv) > 3 else "12").split(",") if g]
waves, max_new, num_b1 = 4, 128, 24
new = SPSTable.from_file(Path(__file__).parent.parent / "profile" / "s53_profile_bf16_median.json").monotone()
s47 = SPSTable.from_file(Path(__file__).parents[2] / "s50" / "sps_ab" / "s47_profile_bf16.json").monotone()
target, labelled, max_len = mixed_frame(max(num_b1, max(batches) * waves), max_new)
max_len += max(gammas, default=7)  # room for the longest draft block past the last token
prompts = [p for _, p in labelled]


def engines_at(bs: int) -> dict:
    out = {BASE: _engine(BASE, target, bs, max_len, "greedy", 7, None, True, {}),
           "shipped": _engine("hybrid", target, bs, max_len, "greedy", 7, None, True, {}),
           "new": _engine("hybrid", target, bs, max_len, "greedy", 7, None, True, {})}
    for g in gammas:
        out[f"new-g{g}"] = _engine("hybrid", target, bs, max_len, "greedy", g, None, True, {})
    for name, e in out.items():
        if name != BASE:
            e.sps = s47 if name == "shipped" else new
    return out


result: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "new_table": new.step_time_ms,
                "by_batch": {}}
for bs in batches:
    engines = engines_at(bs)
    res = arms_vs_target(*run_at(engines, prompts, bs, max_new, rounds, num_b1, waves), labelled)
    result["by_batch"][bs] = res
    print(json.dumps({bs: res}), file=sys.stderr, flush=True)
print(json.dumps(result))
