"""Session 59, Zen 5 EPYC: the hybrid scheduling on this CPU's first shipped bf16 profile (`first_f26m2_bfloat16.json`,
each size timed in a round-robin, the 1-token sample right after the 256-token one) against the shipped one (each
size timed right after an untimed step of its own size). Target-only and the two hybrids (Algorithm 1, the draft gate
on) in turn, mixed eval prompts (24 at batch 1, 32 through 8 slots), 128 tokens, ROUNDS rounds
(`dspark.bench.decode.hybrid_variants_in_turn`); one JSON line per batch size.
    .venv/bin/python docs/results/suffix/s59/profile/settle_ab.py [ROUNDS] [BATCH_SIZES] > settle_ab.jsonl"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.spec.sps import SPSTable

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
BATCH_SIZES = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[4] / "configs" / "profiles" / "cpu-avx512-amd-epyc-f26m2-smollm2-135m-instruct-bfloat16-2t.json"
TABLES = {"first_table": SPSTable.from_file(HERE / "first_f26m2_bfloat16.json").monotone(),
          "settled_table": SPSTable.from_file(SHIPPED).monotone()}
target, labelled, max_len = mixed_frame(32, 128)
prompts = [p for _, p in labelled]


def use(name: str):  # noqa: ANN201 - an engine adjuster
    def adjust(engine) -> None:  # noqa: ANN001 - an Engine
        engine.sps = TABLES[name]
    return adjust


for batch_size in BATCH_SIZES:
    summary, _ = hybrid_variants_in_turn(target, prompts if batch_size > 1 else prompts[:24], max_len, batch_size,
                                         128, ROUNDS, {name: use(name) for name in TABLES})
    print(json.dumps({"batch_size": batch_size, **summary}), flush=True)
