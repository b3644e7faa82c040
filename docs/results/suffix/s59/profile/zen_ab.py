"""Session 59: on a Zen 5 EPYC (CPUID family 26), the hybrid scheduling on the Zen 4 EPYC's shipped SPS profile (what
this CPU found until profiles named the CPU's family and model: both report "AMD EPYC" and the same flags) against
this CPU's own (the median of three `dspark profile` runs here). Target-only and the two hybrids (Algorithm 1, the
draft gate on) in turn, 32 mixed eval prompts through B slots, 128 tokens, ROUNDS rounds
(`dspark.bench.decode.hybrid_variants_in_turn`); one JSON line per batch size.
    .venv/bin/python docs/results/suffix/s59/profile/zen_ab.py [ROUNDS] [BATCH_SIZES] > zen_ab.jsonl"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.spec.sps import SPSTable

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
BATCH_SIZES = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "8,4,1").split(",")]
PROFILES = Path(__file__).resolve().parents[5] / "configs" / "profiles"
TABLES = {name: SPSTable.from_file(PROFILES / f"cpu-avx512-amd-epyc-{cpu}-smollm2-135m-instruct-bfloat16-2t.json")
          .monotone() for name, cpu in (("zen4_profile", "f25m17"), ("zen5_profile", "f26m2"))}
target, labelled, max_len = mixed_frame(32, 128)
prompts = [p for _, p in labelled]


def use(name: str):  # noqa: ANN201 - an engine adjuster
    def adjust(engine) -> None:  # noqa: ANN001 - an Engine
        engine.sps = TABLES[name]
    return adjust


for batch_size in BATCH_SIZES:
    summary, _ = hybrid_variants_in_turn(target, prompts if batch_size > 1 else prompts[:12], max_len, batch_size,
                                         128, ROUNDS, {name: use(name) for name in TABLES})
    print(json.dumps({"batch_size": batch_size, **summary}), flush=True)
