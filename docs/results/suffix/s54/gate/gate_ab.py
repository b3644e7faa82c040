"""Session 54: the draft gate at batch 4-8, where the hybrid sits near break-even: target-only and two hybrids
(Algorithm 1, the shipped profile) differing only in the gate (`gated`: the engine's DraftGate, as shipped; `ungated`:
every round drafts, Algorithm 1 alone decides how much to verify), WAVES x B prompts through B slots, arm by arm in
turn, ROUNDS rounds (`decode.hybrid_variants_in_turn`). Greedy, 128 tokens. One JSON line.
    .venv/bin/python docs/results/suffix/s54/gate/gate_ab.py [BATCH,...] [ROUNDS]"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.kernels.machine import cpu_signature

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "4,8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
waves, max_new = 4, 128
target, labelled, max_len = mixed_frame(max(batches) * waves, max_new)
prompts = [p for _, p in labelled]
result: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "by_batch": {}}
for bs in batches:
    summary, engines = hybrid_variants_in_turn(target, prompts[:bs * waves], max_len + 8, bs, max_new, rounds,
                                               {"gated": lambda e: None, "ungated": lambda e: e.set_draft_gate(None)})
    gate = engines["gated"].gate
    if gate is not None:
        summary["gated"]["gate"] = {"num_drafted": gate.num_drafted, "num_skipped": gate.num_skipped}
    result["by_batch"][bs] = summary
    print(json.dumps({bs: summary}), file=sys.stderr, flush=True)
print(json.dumps(result))
