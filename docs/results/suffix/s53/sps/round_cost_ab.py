"""Session 53: Algorithm 1 on the profile's forward time T(n) against T(n) + F(B), F the measured time a round spends
beside its forward (`spec/round_cost.py`), side by side in one process: target-only and two hybrid engines (the
draft gate on, the shipped step curve) differing only in that (`off`: `engine.round_cost = None`). At batch B,
max(WAVES x B, 16) mixed prompts through B slots (continuous batching), the arms in turn (order rotated), ROUNDS
rounds; greedy, 128 tokens (`dspark.bench.decode.hybrid_variants_in_turn`). Prints one JSON line, with F(B) as the
`on` engine learnt it.
Runs at commit 468f12b (the experiment, reverted in the commit after it).
    .venv/bin/python docs/results/suffix/s53/sps/round_cost_ab.py [BATCH,...] [ROUNDS] > round_cost_ab.json"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.kernels.machine import cpu_signature

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16,32").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
waves, max_new = 4, 128
target, labelled, max_len = mixed_frame(max(16, max(batches) * waves), max_new)
prompts = [p for _, p in labelled]
out: dict = {"cpu": cpu_signature(), "waves": waves, "rounds": rounds, "by_batch": {}}
for bs in batches:
    res, engines = hybrid_variants_in_turn(
        target, prompts[:max(16, bs * waves)], max_len, bs, max_new, rounds,
        {"off": lambda e: setattr(e, "round_cost", None), "on": lambda e: None})
    res["fixed_ms_learnt"] = {b: round(ms, 2) for b, ms in sorted(engines["on"].round_cost._ms.items())}
    out["by_batch"][bs] = res
    print(json.dumps({bs: res}), file=sys.stderr, flush=True)
print(json.dumps(out))
