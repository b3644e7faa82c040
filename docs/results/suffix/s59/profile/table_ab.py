"""Session 59, Zen 5 EPYC: the hybrid scheduling on one SPS table against another. Target-only and one hybrid per
table (Algorithm 1, the draft gate on) in turn, mixed eval prompts (B1_PROMPTS at batch 1, 32 through B slots),
128 tokens, ROUNDS rounds (`dspark.bench.decode.hybrid_variants_in_turn`); one JSON line per batch size.
    .venv/bin/python docs/results/suffix/s59/profile/table_ab.py ROUNDS BATCH_SIZES B1_PROMPTS NAME=PROFILE.json ...
zen_ab.jsonl: 3 8,4,1 12 zen4_profile=configs/profiles/cpu-avx512-amd-epyc-f25m17-smollm2-135m-instruct-bfloat16-2t.json
  zen5_profile=docs/results/suffix/s59/profile/first_f26m2_bfloat16.json
settle_ab.jsonl: 3 1,8 24 first_table=docs/results/suffix/s59/profile/first_f26m2_bfloat16.json
  settled_table=configs/profiles/cpu-avx512-amd-epyc-f26m2-smollm2-135m-instruct-bfloat16-2t.json"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.spec.sps import SPSTable

ROUNDS, BATCH_SIZES, B1_PROMPTS = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
TABLES = {name: SPSTable.from_file(path).monotone() for name, path in (a.split("=", 1) for a in sys.argv[4:])}
target, labelled, max_len = mixed_frame(32, 128)
prompts = [p for _, p in labelled]


def use(name: str):  # noqa: ANN201 - an engine adjuster
    def adjust(engine) -> None:  # noqa: ANN001 - an Engine
        engine.sps = TABLES[name]
    return adjust


for batch_size in BATCH_SIZES:
    summary, _ = hybrid_variants_in_turn(target, prompts if batch_size > 1 else prompts[:B1_PROMPTS], max_len,
                                         batch_size, 128, ROUNDS, {name: use(name) for name in TABLES})
    print(json.dumps({"batch_size": batch_size, **summary}), flush=True)
