"""Session 60: the hybrid's draft block γ at batch 1 (7, the shipped, against longer blocks). Target-only and one
hybrid engine per γ (Algorithm 1 picks each round's length up to γ; the draft gate on, the shipped profile), in turn
on each of N mixed eval prompts (order reversed every other prompt), 128 greedy tokens. Per arm: tok/s, × target-only,
greedy output identical, the accepted counts of the rounds that verified a draft. One JSON line.
    .venv/bin/python docs/results/suffix/s60/gamma/gamma_ab.py N GAMMAS > gamma_ab.jsonl   (e.g. 12 7,11,15)"""

from __future__ import annotations

import collections
import json
import sys
import time

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.verify_service.request import SamplingParams

N, GAMMAS = int(sys.argv[1]), [int(g) for g in sys.argv[2].split(",")]
target, labelled, max_len = mixed_frame(N, 128)
max_len += max(GAMMAS)
engines = {BASE: _engine(BASE, target, 1, max_len, "greedy", 7, None, True, {})}
for g in GAMMAS:
    engines[f"gamma{g}"] = _engine("hybrid", target, 1, max_len, "greedy", g, None, True, {})
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)
for engine in engines.values():
    engine.generate([labelled[0][1][:8]], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.stats.clear()
wall: dict[str, float] = collections.defaultdict(float)
outs: dict[str, list[list[int]]] = collections.defaultdict(list)
for i, (_, prompt) in enumerate(labelled):
    for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
        t0 = time.perf_counter()
        outs[name].append(engines[name].generate([prompt], params)[0].output_ids)
        wall[name] += time.perf_counter() - t0
base = sum(map(len, outs[BASE])) / wall[BASE]
res: dict = {"cpu": cpu_signature(), "prompts": N, "target_only_tok_s": round(base, 1), "arms": {}}
for name, engine in engines.items():
    if name == BASE:
        continue
    tok_s = sum(map(len, outs[name])) / wall[name]
    steps = [s for s in engine.stats if s.num_requests == 1 and s.lengths and s.lengths[0] > 0]
    res["arms"][name] = {"tok_s": round(tok_s, 1), "speedup": round(tok_s / base, 3),
                         "greedy_identical": outs[name] == outs[BASE],
                         "accepted_when_verified": dict(sorted(collections.Counter(
                             s.num_accepted[0] for s in steps).items()))}
print(json.dumps(res))
