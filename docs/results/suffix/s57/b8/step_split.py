"""Session 57: where a batch-8 run's time goes, target-only against the hybrid (Algorithm 1, the draft gate on), in
one process, runs in turn (T H T H ...): 32 mixed eval prompts through 8 slots, 128 tokens each (greedy), each run
its own served-text tenant. Per arm and run: wall time, steps, steps that drafted, tokens verified beyond the next
one and accepted, and the sums of the steps' phases (draft, schedule, verify = forward + features; the rest =
commit, prefill, admission, Python between steps), plus per drafted and plain step their mean ms. One JSON line.
    .venv/bin/python docs/results/suffix/s57/b8/step_split.py [RUNS]"""

from __future__ import annotations

import json
import statistics
import sys
import time

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.verify_service.request import SamplingParams

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
target, labelled, max_len = mixed_frame(32, 128)
prompts = [p for _, p in labelled]
engines = {name: _engine(name, target, 8, max_len, "greedy", 7, None, True, {}) for name in (BASE, "hybrid")}
runs: dict[str, list[dict]] = {n: [] for n in engines}
for k in range(RUNS + 1):  # run 0 warms both up (kernels, the gate's first measurements) and is left out
    for name, engine in engines.items():
        engine.stats.clear()
        t0 = time.perf_counter()
        # one served-text store a run (as bench decode's rounds): a run must not draft an earlier run's outputs back
        outs = engine.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True, tenant=f"run-{k}"))
        wall = (time.perf_counter() - t0) * 1e3
        stats = engine.stats
        drafted = [s for s in stats if sum(s.lengths) > 0]
        plain = [s for s in stats if sum(s.lengths) == 0]
        phases = {p: sum(getattr(s, p) for s in stats) for p in ("draft_ms", "schedule_ms", "verify_ms")}
        if k:
            runs[name].append({
                "wall_ms": wall, "tokens": sum(len(o.output_ids) for o in outs), "steps": len(stats),
                "drafted_steps": len(drafted), "verified": sum(sum(s.lengths) for s in stats),
                "accepted": sum(sum(s.num_accepted) for s in stats), **phases,
                "rest_ms": wall - sum(phases.values()),
                "drafted_step_ms": statistics.fmean(s.verify_ms + s.draft_ms + s.schedule_ms for s in drafted)
                if drafted else None,
                "plain_step_ms": statistics.fmean(s.verify_ms + s.draft_ms + s.schedule_ms for s in plain)
                if plain else None})
summary = {n: {key: round(statistics.median(r[key] for r in rs), 2) if rs[0][key] is not None else None
               for key in rs[0]} for n, rs in runs.items()}
summary["hybrid_speedup_by_run"] = [round(b["wall_ms"] / h["wall_ms"], 3) for b, h in zip(runs[BASE], runs["hybrid"])]
print(json.dumps({"cpu": cpu_signature(), "runs": RUNS, **summary}))
