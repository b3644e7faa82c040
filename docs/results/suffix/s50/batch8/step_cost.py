"""Session 50: where a batch-B step's time goes, from the engines' own step records (session 49's
`s49/step_cost/step_cost.py` with the batch and the waves as arguments, a tenant per run so that the second run's
served-text source does not draft the first run's outputs back, and the tokens a step committed). Target-only and
the hybrid (Algorithm 1, the draft gate on, the shipped profile) decode WAVES x B prompts through B slots
(continuous batching), each run twice in turn; of the steps at exactly B requests: the wall time between step
starts, drafting, scheduling and the verify part (forward, acceptance, handing the drafter its features), the
verify ms against the tokens a step carried (least squares), and the wall ms per committed token. Prints one JSON
line.
    .venv/bin/python docs/results/suffix/s50/batch8/step_cost.py 8 4 > step_cost_b8.json"""

from __future__ import annotations

import json
import statistics
import sys

from dspark.bench.decode import BASE, _engine, mixed_frame, run_engine
from dspark.kernels.machine import cpu_signature

BS, WAVES, MAX_NEW = int(sys.argv[1]), int(sys.argv[2]), 128
target, labelled, max_len = mixed_frame(BS * WAVES, MAX_NEW)
prompts = [p for _, p in labelled]
engines = {name: _engine(name, target, BS, max_len, "greedy", 7, None, True, {}) for name in (BASE, "hybrid")}
out: dict = {"cpu": cpu_signature(), "batch": BS, "waves": WAVES, "arms": {}}
records: dict[str, list] = {name: [] for name in engines}
tok_s: dict[str, list[float]] = {name: [] for name in engines}
for rnd in range(2):
    for name, engine in engines.items():
        run = run_engine(engine, prompts, BS, MAX_NEW, refill=True, tenant=f'r{rnd}')
        tok_s[name].append(run.tok_s)
        steps = list(engine.stats)
        for a, b in zip(steps, steps[1:]):
            if a.num_requests == BS:
                records[name].append((a.num_tokens, a.draft_ms, a.schedule_ms, a.verify_ms,
                                      (b.start_s - a.start_s) * 1e3, sum(a.num_accepted) + a.num_requests))
for name, rec in records.items():
    tokens = [r[0] for r in rec]
    verify = [r[3] for r in rec]
    arm = {"tok_s": [round(t, 1) for t in tok_s[name]], "steps": len(rec),
           "tokens_mean": round(statistics.mean(tokens), 2),
           "wall_ms_median": round(statistics.median(r[4] for r in rec), 2),
           "draft_ms_median": round(statistics.median(r[1] for r in rec), 3),
           "schedule_ms_median": round(statistics.median(r[2] for r in rec), 3),
           "verify_ms_median": round(statistics.median(verify), 2),
           "committed_mean": round(statistics.mean(r[5] for r in rec), 2),
           "wall_ms_mean": round(statistics.mean(r[4] for r in rec), 2),
           "draft_ms_mean": round(statistics.mean(r[1] for r in rec), 3),
           "verify_ms_mean": round(statistics.mean(r[3] for r in rec), 3),
           "ms_per_committed": round(sum(r[4] for r in rec) / sum(r[5] for r in rec), 3),
           "outside_ms_median": round(statistics.median(r[4] - r[1] - r[2] - r[3] for r in rec), 2)}
    if len(set(tokens)) > 1:
        fit = statistics.linear_regression(tokens, verify)
        arm["verify_ms_per_token"] = round(fit.slope, 3)
        arm["verify_ms_at_32_tokens"] = round(fit.intercept + 32 * fit.slope, 2)
    out["arms"][name] = arm
    print(name, arm, file=sys.stderr, flush=True)
print(json.dumps(out))
