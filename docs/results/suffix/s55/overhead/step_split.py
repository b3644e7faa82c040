"""Session 55: a step's wall time split into its parts, target-only against the hybrid (Algorithm 1, greedy), B slots,
4 x B mixed eval prompts refilled (continuous batching), 128 tokens, the arms in turn ROUNDS times (one served-text
tenant per round). Each part is timed by a wrapper around the engine's own function (forward, acceptance, proposal,
schedule, commit, the drafter's features, the round's record, releasing finished requests); "rest" is the step's
time outside them. Prints per arm and round: ms a step of each part, steps, wall; and the hybrid's verified and
accepted drafts a request a step.
    .venv/bin/python docs/results/suffix/s55/overhead/step_split.py [ROUNDS] [B]"""

from __future__ import annotations

import collections
import json
import sys
import time

import dspark.verify_service.engine as engine_module
import dspark.verify_service.step.draft as draft_step
import dspark.verify_service.step.verify as verify_step
from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.verify_service.request import SamplingParams

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
target, labelled, max_len = mixed_frame(4 * B, 128)
prompts = [p for _, p in labelled]
spent: collections.Counter = collections.Counter()


def timed(owner: object, name: str, key: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        spent[key] += time.perf_counter() - t0
        return out

    setattr(owner, name, wrapper)


timed(verify_step, "accept", "accept")
timed(draft_step, "propose", "propose")
for fn in ("schedule", "commit", "feed_drafter"):
    timed(engine_module, fn, fn)
for fn in ("_record_round", "_feature_layers", "_release_finished", "_reap_aborted"):
    timed(engine_module.Engine, fn, fn.strip("_"))
engines = {n: _engine(n, target, B, max_len + 8, "greedy", 7, None, True, {}) for n in (BASE, "hybrid")}
for engine in engines.values():
    timed(engine.runner, "forward", "forward")
    timed(engine, "step", "step")
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True, tenant="warm-up"))
res: dict = {"cpu": cpu_signature(), "batch": B, "prompts": len(prompts), "arms": {}}
for r in range(ROUNDS):
    for name, engine in engines.items():
        spent.clear()
        n0 = len(engine.stats)
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, tenant=f"r{r}"))
        wall = time.perf_counter() - t0
        st = engine.stats[n0:]
        per = {k: round(v / len(st) * 1e3, 3) for k, v in spent.items()}
        per["rest"] = round(per["step"] - sum(v for k, v in per.items() if k != "step"), 3)
        reqs = max(1, sum(s.num_requests for s in st))
        res["arms"].setdefault(name, []).append({
            "ms_a_step": per, "steps": len(st), "wall_s": round(wall, 3),
            "verified_per_request": round(sum(sum(s.lengths) for s in st) / reqs, 3),
            "accepted_per_request": round(sum(sum(s.num_accepted) for s in st) / reqs, 3)})
print(json.dumps(res))
