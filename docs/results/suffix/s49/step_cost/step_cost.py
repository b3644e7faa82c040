"""Session 49: where a batch-32 hybrid step's time goes beyond the forward. Target-only and the hybrid (Algorithm 1,
the draft gate on, the shipped profile) decode 4 x 32 prompts through 32 slots (continuous batching), each run
twice in turn; from the engines' own step records (`Engine.stats`) of the steps at exactly 32 requests: the wall
time between step starts, and inside it drafting, scheduling and the verify part (forward, acceptance, handing
the drafter its features), then verify ms against the tokens a step carried (least squares: the marginal ms per
verified token, to set beside the forward's own, ~0.75 ms at 32 requests in `s49/sps_ab`). Prints one JSON line.
    .venv/bin/python docs/results/suffix/s49/step_cost/step_cost.py"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from dspark.bench.decode import BASE, _engine, run_engine
from dspark.kernels.machine import cpu_signature
from dspark.models.target.loader import load_target
from dspark.prompts.eval_sets import mixed_prompts

torch.set_num_threads(2)
BS, WAVES, MAX_NEW = 32, 4, 128
target = load_target(dtype="bf16")
torch.manual_seed(0)
prompts = [p for _, p in mixed_prompts(target.tokenizer, BS * WAVES)]
max_len = max(map(len, prompts)) + MAX_NEW + 9
engines = {name: _engine(name, target, BS, max_len, "greedy", 7, None, True, {}) for name in (BASE, "hybrid")}
out: dict = {"cpu": cpu_signature(), "batch": BS, "waves": WAVES, "arms": {}}
records: dict[str, list] = {name: [] for name in engines}
tok_s: dict[str, list[float]] = {name: [] for name in engines}
for _ in range(2):
    for name, engine in engines.items():
        run = run_engine(engine, prompts, BS, MAX_NEW, refill=True)
        tok_s[name].append(run.tok_s)
        steps = list(engine.stats)
        for a, b in zip(steps, steps[1:]):
            if a.num_requests == BS:
                records[name].append((a.num_tokens, a.draft_ms, a.schedule_ms, a.verify_ms,
                                      (b.start_s - a.start_s) * 1e3))
for name, rec in records.items():
    tokens = [r[0] for r in rec]
    verify = [r[3] for r in rec]
    arm = {"tok_s": [round(t, 1) for t in tok_s[name]], "steps": len(rec),
           "tokens_mean": round(statistics.mean(tokens), 2),
           "wall_ms_median": round(statistics.median(r[4] for r in rec), 2),
           "draft_ms_median": round(statistics.median(r[1] for r in rec), 3),
           "schedule_ms_median": round(statistics.median(r[2] for r in rec), 3),
           "verify_ms_median": round(statistics.median(verify), 2),
           "outside_ms_median": round(statistics.median(r[4] - r[1] - r[2] - r[3] for r in rec), 2)}
    if len(set(tokens)) > 1:
        fit = statistics.linear_regression(tokens, verify)
        arm["verify_ms_per_token"] = round(fit.slope, 3)
        arm["verify_ms_at_32_tokens"] = round(fit.intercept + 32 * fit.slope, 2)
    out["arms"][name] = arm
    print(name, arm, file=sys.stderr, flush=True)
print(json.dumps(out))
