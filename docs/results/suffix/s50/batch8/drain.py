"""Session 50: where a batch-8 run's time goes by the number of requests a step had. Target-only and the hybrid
(Algorithm 1, the draft gate on, the shipped profile) decode 32 mixed prompts through 8 slots (continuous batching,
128 tokens, greedy), ROUNDS runs each in turn (a tenant per run); per run and step size: steps, wall ms (step start
to the next step's start), tokens committed, tokens through the target. Steps below 8 requests are a run's
admissions (a finished slot is refilled by a prompt riding in the next step) and its drain (the last requests
alone). Prints one JSON line.
    .venv/bin/python docs/results/suffix/s50/batch8/drain.py [ROUNDS] > drain_b8.json"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from dspark.bench.decode import BASE, _engine, mixed_frame, run_engine
from dspark.kernels.machine import cpu_signature

BS, ROUNDS = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 2
target, labelled, max_len = mixed_frame(4 * BS, 128)
prompts = [p for _, p in labelled]
engines = {n: _engine(n, target, BS, max_len, "greedy", 7, None, True, {}) for n in (BASE, "hybrid")}
out: dict = {"cpu": cpu_signature(), "batch": BS, "runs": []}
for r in range(ROUNDS):
    for name, engine in engines.items():
        run = run_engine(engine, prompts, BS, 128, refill=True, tenant=f"run-{r}")
        steps = list(engine.stats)
        by_size: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
        for a, b in zip(steps, steps[1:] + [None]):
            g = by_size[a.num_requests]
            g[0] += 1
            g[1] += ((b.start_s if b else a.end_s) - a.start_s) * 1e3
            g[2] += sum(a.num_accepted) + a.num_requests
            g[3] += a.num_tokens
        out["runs"].append({"round": r, "arm": name, "tok_s": round(run.tok_s, 1), "by_requests": {
            n: {"steps": g[0], "wall_ms": round(g[1]), "committed": g[2], "through": g[3]}
            for n, g in sorted(by_size.items())}})
        print(json.dumps(out["runs"][-1]), file=sys.stderr, flush=True)
print(json.dumps(out))
