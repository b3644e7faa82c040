"""Session 50: the live survival shift's learning rate (SuffixConfig.live_bias_rate, shipped 0.005) against faster ones,
side by side in one process. Target-only and hybrid engines (Algorithm 1, the draft gate on, the shipped profile)
differing only in η. At batch B, WAVES x B prompts through B slots (continuous batching), the arms in turn (order
rotated), ROUNDS rounds (each engine keeps what it learnt across rounds, as a serving replica does); greedy, 128
tokens. Prints one JSON line (`bias_rate_ab.json` here was written before the script reported the steady state).
    .venv/bin/python docs/results/suffix/s50/bias_rate/bias_rate_ab.py [BATCH,...] [ROUNDS] [RATE,...]"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from dspark.bench.decode import hybrid_variants_in_turn, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.verify_service.engine import Engine

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "4,8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
rates = [float(r) for r in (sys.argv[3] if len(sys.argv) > 3 else "0.005,0.02,0.05").split(",")]
waves, max_new = 4, 128
target, labelled, max_len = mixed_frame(max(batches) * waves, max_new)
prompts = [p for _, p in labelled]
out: dict = {"cpu": cpu_signature(), "waves": waves, "rounds": rounds, "by_batch": {}}


def rate_of(rate: float) -> Callable[[Engine], None]:
    return lambda engine: setattr(engine.drafter.suffix.config, "live_bias_rate", rate)


for bs in batches:
    summary, engines = hybrid_variants_in_turn(target, prompts[:bs * waves], max_len, bs, max_new, rounds,
                                               {f"eta={rate}": rate_of(rate) for rate in rates})
    for arm in engines:
        if arm in summary:
            summary[arm]["bias"] = {f"{s}/{r}": [round(b, 3) for b in v]
                                    for (s, r), v in engines[arm].drafter.suffix.calibration.bias.items()}
    out["by_batch"][bs] = summary
    print(json.dumps(summary), file=sys.stderr, flush=True)
print(json.dumps(out))
