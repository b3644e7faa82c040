"""Session 56: the hybrid's corpus walks with a longer context than 8 tokens, side by side in one process: target-only
and one hybrid per VARIANT (Algorithm 1 on the shipped step curve, the draft gate on), WAVES x B prompts through B
slots, arm by arm in turn, ROUNDS rounds (`decode.hybrid_variants_in_turn`). Greedy, 128 tokens. VARIANT `ctx-N`: the
global index matched on up to N context tokens (shipped: 8; the matched length is binary searched since session 56,
so a longer cap costs about one search more a walk). One JSON line.
    [WAVES=4] .venv/bin/python docs/results/suffix/s56/ctx_ab.py BATCH,... ROUNDS VARIANT,..."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.verify_service.engine import Engine


def variant(name: str) -> Callable[[Engine], None]:
    n = int(name.removeprefix("ctx-"))

    def adjust(engine: Engine) -> None:
        suffix = engine.drafter.suffix  # type: ignore[union-attr]
        suffix.config = dataclasses.replace(suffix.config, walk=dataclasses.replace(suffix.config.walk, max_ctx=n))
    return adjust


batches, rounds = [int(b) for b in sys.argv[1].split(",")], int(sys.argv[2])
variants = {name: variant(name) for name in sys.argv[3].split(",")}
waves, max_new = int(os.environ.get("WAVES", "4")), 128
target, labelled, max_len = mixed_frame(max(batches) * waves, max_new)
prompts = [p for _, p in labelled]
result: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "by_batch": {}}
for bs in batches:
    summary, _ = hybrid_variants_in_turn(target, prompts[:bs * waves], max_len, bs, max_new, rounds, variants)
    result["by_batch"][bs] = summary
    print(json.dumps({bs: summary}), file=sys.stderr, flush=True)
print(json.dumps(result))
