"""Session 52: huge pages for the packed weights and the KV cache (kernels/huge_pages.py) in the engine, side by
side in one process. Four engines: target-only and the hybrid (Algorithm 1, the draft gate on, the shipped
profile), each with its runner's weights packed and its KV cache allocated on 4 KiB pages (DSPARK_HUGE_PAGES=0
while it is built and packs: `4k`) and on huge pages (`huge`). Batch 1: NUM mixed prompts, the arms in turn on
each prompt (`run_interleaved`); batch B > 1: WAVES x B prompts through B slots, arm by arm in turn, ROUNDS rounds
(`run_refilled_in_turn`); `dspark.bench.decode.change_ab`. Greedy, 128 tokens; outputs compared across the four arms.
Prints one JSON line: tok/s per arm, hybrid / target-only on the same pages, huge / 4k for each.
    .venv/bin/python docs/results/suffix/s52/huge_pages/engine_ab.py [BATCH,...] [ROUNDS] > engine_ab.json"""

from __future__ import annotations

import json
import os
import sys

from dspark.bench.decode import BASE, _engine, change_ab, mixed_frame
from dspark.kernels import huge_pages
from dspark.kernels.machine import cpu_signature

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,4,8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
waves, max_new, num_b1 = 4, 128, 24
target, labelled, max_len = mixed_frame(max(num_b1, max(batches) * waves), max_new)
prompts = [p for _, p in labelled]


def built(kind: str, bs: int, huge: bool):
    """An engine whose runner allocates its KV cache and packs its weights with huge pages on or off."""
    os.environ[huge_pages.ENV] = "1" if huge else "0"
    engine = _engine(kind, target, bs, max_len, "greedy", 7, None, True, {})
    runner = engine.runner
    linears = [x for ly in runner.layers for x in (ly.qkv, ly.o, ly.gate_up, ly.down) if x is not None]
    for lin in [*linears, runner.lm_head]:
        if lin.takes_dpbf16 or lin.takes_amx:
            lin.amx_weight()
    os.environ[huge_pages.ENV] = "1"
    return engine


out: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "by_batch": {}}
for bs in batches:
    engines = {BASE: built(BASE, bs, False), "target-huge": built(BASE, bs, True),
               "hybrid-4k": built("hybrid", bs, False), "hybrid-huge": built("hybrid", bs, True)}
    res = change_ab(engines, "4k", "huge", prompts, bs, max_new, rounds, num_b1, waves)
    out["by_batch"][bs] = res
    print(json.dumps({bs: res}), file=sys.stderr, flush=True)
print(json.dumps(out))
