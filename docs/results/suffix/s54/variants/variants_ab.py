"""Session 54: the hybrid at batch 4-8, where it sits near break-even, against variants of its engine, side by side in
one process: target-only and one hybrid per VARIANT (Algorithm 1 on the shipped step curve, the draft gate on, unless
the variant says otherwise), WAVES x B prompts through B slots, arm by arm in turn, ROUNDS rounds
(`decode.hybrid_variants_in_turn`). Greedy, 128 tokens. One JSON line; a hybrid with a draft gate also reports the
rounds it drafted and skipped. VARIANT: `gated` / `greedy` (as shipped), `ungated` (every round drafts: Algorithm 1
alone decides how much to verify), `fixed-K` (every request verifies up to K drafts, whatever their survival).
gate_ab.json: `variants_ab.py 4,8 3 gated,ungated`; sched_ab.json: `variants_ab.py 8 3 greedy,fixed-1,fixed-2` (both
written by the two scripts this one merges, which reported the gate's rounds for `gated` only).
    .venv/bin/python docs/results/suffix/s54/variants/variants_ab.py BATCH,... ROUNDS VARIANT,..."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.spec.schedulers import make_scheduler
from dspark.verify_service.engine import Engine


def variant(name: str) -> Callable[[Engine], None]:
    if name in ("gated", "greedy"):
        return lambda e: None
    if name == "ungated":
        return lambda e: e.set_draft_gate(None)
    if name.startswith("fixed-"):
        return lambda e: e.set_scheduler(make_scheduler("fixed", k=int(name.removeprefix("fixed-"))))
    raise SystemExit(f"unknown variant {name!r}")


batches, rounds = [int(b) for b in sys.argv[1].split(",")], int(sys.argv[2])
variants = {name: variant(name) for name in sys.argv[3].split(",")}
waves, max_new = 4, 128
target, labelled, max_len = mixed_frame(max(batches) * waves, max_new)
prompts = [p for _, p in labelled]
result: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "by_batch": {}}
for bs in batches:
    summary, engines = hybrid_variants_in_turn(target, prompts[:bs * waves], max_len, bs, max_new, rounds, variants)
    for name in variants:
        gate = engines[name].gate
        if gate is not None:
            summary[name]["gate"] = {"num_drafted": gate.num_drafted, "num_skipped": gate.num_skipped}
    result["by_batch"][bs] = summary
    print(json.dumps({bs: summary}), file=sys.stderr, flush=True)
print(json.dumps(result))
