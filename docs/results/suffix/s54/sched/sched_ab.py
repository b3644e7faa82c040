"""Session 54: does Algorithm 1 verify too little at batch 8? Target-only and hybrids differing only in the prefix
scheduler: `greedy` (Algorithm 1 on the shipped step curve, as shipped), `fixed-K` (every request verifies up to K of
its drafts, whatever their survival), WAVES x B prompts through B slots, arm by arm in turn, ROUNDS rounds
(`decode.hybrid_variants_in_turn`; the draft gate on in every hybrid). Greedy, 128 tokens. One JSON line.
    .venv/bin/python docs/results/suffix/s54/sched/sched_ab.py [BATCH,...] [ROUNDS] [K,...]"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.spec.schedulers import make_scheduler

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
ks = [int(k) for k in (sys.argv[3] if len(sys.argv) > 3 else "1,2").split(",")]
waves, max_new = 4, 128
target, labelled, max_len = mixed_frame(max(batches) * waves, max_new)
prompts = [p for _, p in labelled]
variants = {"greedy": lambda e: None}
for k in ks:
    variants[f"fixed-{k}"] = lambda e, k=k: e.set_scheduler(make_scheduler("fixed", k=k))
result: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "by_batch": {}}
for bs in batches:
    summary, _ = hybrid_variants_in_turn(target, prompts[:bs * waves], max_len + 8, bs, max_new, rounds, variants)
    result["by_batch"][bs] = summary
    print(json.dumps({bs: summary}), file=sys.stderr, flush=True)
print(json.dumps(result))
