"""Session 50: the Zen 4 EPYC's bf16 step curve measured again (with the k-blocked GEMM) against session 47's, side
by side in one process. Target-only and two hybrid engines (Algorithm 1, the draft gate on) differing only in the
step-time table they schedule on: `new` the median of 3 `dspark profile` runs with this session's kernels
(`../profile/s50_profile_bf16_median.json`; shipped in b1f8a41, when the first two JSONs here were made), `s47`
session 47's (`s47_profile_bf16.json` here, shipped again since ca42206). At batch B, WAVES x B prompts through B
slots (continuous batching), the arms in turn (order rotated), ROUNDS rounds; greedy, 128 tokens. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s50/sps_ab/sps_ab.py docs/results/suffix/s50/sps_ab/s47_profile_bf16.json \
        [BATCH,...] [ROUNDS]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.spec.sps import SPSTable

old = SPSTable.from_file(sys.argv[1]).monotone()
new = SPSTable.from_file(Path(__file__).parent.parent / "profile" / "s50_profile_bf16_median.json").monotone()
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "4,8").split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
waves, max_new = 4, 128
target, labelled, max_len = mixed_frame(max(batches) * waves, max_new)
prompts = [p for _, p in labelled]
out: dict = {"cpu": cpu_signature(), "waves": waves, "rounds": rounds, "by_batch": {}}
assert new.step_time_ms != old.step_time_ms
for bs in batches:
    out["by_batch"][bs], _ = hybrid_variants_in_turn(
        target, prompts[:bs * waves], max_len, bs, max_new, rounds,
        {"new": lambda e: setattr(e, "sps", new), "s47": lambda e: setattr(e, "sps", old)})
    print(json.dumps(out["by_batch"][bs]), file=sys.stderr, flush=True)
print(json.dumps(out))
