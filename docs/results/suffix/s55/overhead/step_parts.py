"""Session 55 (session 54's script with a warm-up and one served-text tenant per round, so every round is
comparable): where a hybrid round's time goes beside a target-only step at batch B (one process, same prompts).
Runs target-only and the hybrid (Algorithm 1, the draft gate on, greedy, 128 tokens) on WAVES x B prompts through B
slots, arm by arm in turn, ROUNDS rounds, then prints per arm: tokens/s, steps, mean step wall time and its parts
(draft, schedule, verify+feed from the engine's StepStats; the rest = commit, admission, python), tokens verified a
request, and with --profile a cProfile of the last round's top functions by own time. No warm-up: each engine's
first round includes its one-time weight packing (`native.amx_pack`, ~1.4 s under the profiler here); the hybrid's
later rounds repeat its served-text source's prompts (only round 1 and target-only's rounds are comparable there).
    .venv/bin/python docs/results/suffix/s54/overhead/step_parts.py B [ROUNDS] [--profile]"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.verify_service.request import SamplingParams

bs = int(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 2
profile = "--profile" in sys.argv
waves, max_new = (8 if bs == 1 else 3), 128
target, labelled, max_len = mixed_frame(bs * waves, max_new)
max_len += 8
prompts = [p for _, p in labelled]
engines = {BASE: _engine(BASE, target, bs, max_len, "greedy", 7, None, True, {}),
           "hybrid": _engine("hybrid", target, bs, max_len, "greedy", 7, None, True, {})}


def run(engine, tenant: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True, tenant=f"round-{tenant}")
    ids = [engine.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    n0 = len(engine.stats)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    wall = time.perf_counter() - t0
    return wall, n0, [outs[i] for i in ids]


for engine in engines.values():  # warm-up: weight packing and first-call costs stay out of the rounds
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True, tenant="warm-up"))
res: dict = {"cpu": cpu_signature(), "batch": bs, "rounds": rounds, "arms": {}}
profs = {}
for rnd in range(rounds):
    for name, engine in engines.items():
        prof = cProfile.Profile() if profile and rnd == rounds - 1 else None
        if prof:
            prof.enable()
        wall, n0, outs = run(engine, rnd)
        if prof:
            prof.disable()
            profs[name] = prof
        st = engine.stats[n0:]
        a = res["arms"].setdefault(name, {"wall_s": [], "steps": [], "draft_ms": [], "schedule_ms": [],
                                          "verify_ms": [], "verify_len": [], "outputs": None})
        a["wall_s"].append(round(wall, 3))
        a["steps"].append(len(st))
        a["draft_ms"].append(round(sum(s.draft_ms for s in st), 1))
        a["schedule_ms"].append(round(sum(s.schedule_ms for s in st), 1))
        a["verify_ms"].append(round(sum(s.verify_ms for s in st), 1))
        a["verify_len"].append(round(sum(sum(s.lengths) for s in st) / max(1, sum(s.num_requests for s in st)), 3))
        pred = acc = 0.0
        for s_ in st:  # the scheduler's expected accepted drafts (prefix survival of what it verified) vs actual
            for conf, n, k in zip(s_.confidences or [], s_.lengths, s_.num_accepted):
                surv = 1.0
                for c in conf[:n]:
                    surv *= c
                    pred += surv
                acc += k
        a.setdefault("expected_accepted", []).append(round(pred, 1))
        a.setdefault("accepted", []).append(sum(sum(s_.num_accepted) for s_ in st))
        a["outputs"] = a["outputs"] or outs
        a["identical"] = outs == res["arms"][BASE]["outputs"]
for a in res["arms"].values():
    a.pop("outputs")
base = res["arms"][BASE]
res["speedup_by_round"] = [round(b / h, 3) for b, h in zip(base["wall_s"], res["arms"]["hybrid"]["wall_s"])]
print(json.dumps(res))
for name, prof in profs.items():
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(f"==== {name}\n" + s.getvalue(), file=sys.stderr)
