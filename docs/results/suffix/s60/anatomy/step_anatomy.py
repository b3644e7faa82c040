"""Session 60: where a batch-1 step's time goes, target-only against the hybrid, in the engine. N mixed eval prompts
(evaluation only), 128 greedy tokens, the two engines in turn on each prompt (Algorithm 1, the draft gate on, the
shipped profile). Per engine: tokens per second, rounds, the mean time a round spends drafting (the draft source, as
the engine's `_round` sees it), scheduling, in the verify forward and acceptance (`verify_round`), committing and
feeding the drafter; the median forward time by tokens in the forward (`TargetRunner.forward`); for the hybrid the
verified lengths, the accepted counts of the rounds that verified a draft, and the median drafting time by the source
it chose (DSpark's forward where it drafted). One JSON line.
    .venv/bin/python docs/results/suffix/s60/anatomy/step_anatomy.py [N] > step_anatomy.jsonl"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time

import dspark.verify_service.engine as engine_module
from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.models.target.runner import TargetRunner
from dspark.verify_service.request import SamplingParams

N = int(sys.argv[1]) if len(sys.argv) > 1 else 12
phase_s: dict[tuple[str, str], float] = collections.defaultdict(float)
forward_ms: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
current = [BASE]


def timed_phase(name: str) -> None:
    inner = getattr(engine_module, name)

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the phase's own signature
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        phase_s[(current[0], name)] += time.perf_counter() - t0
        return out
    setattr(engine_module, name, timed)


for phase in ("schedule", "verify_round", "commit", "feed_drafter"):
    timed_phase(phase)
forward = TargetRunner.forward


def timed_forward(self, chunks, hidden_layers=()):  # noqa: ANN001, ANN202 - the runner's own signature
    t0 = time.perf_counter()
    out = forward(self, chunks, hidden_layers)
    forward_ms[(id(self), sum(len(c.token_ids) for c in chunks))].append((time.perf_counter() - t0) * 1e3)
    return out


TargetRunner.forward = timed_forward
target, labelled, max_len = mixed_frame(N, 128)
engines = {name: _engine(name, target, 1, max_len, "greedy", 7, None, True, {}) for name in (BASE, "hybrid")}
rounds: collections.Counter = collections.Counter()
for name, engine in engines.items():
    inner_round = engine._round

    def counted(*args, _inner=inner_round, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = _inner(*args, **kwargs)
        phase_s[(_name, "round")] += time.perf_counter() - t0
        rounds[_name] += 1
        return out
    engine._round = counted
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)
for engine in engines.values():
    engine.generate([labelled[0][1][:8]], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.stats.clear()
phase_s.clear()
forward_ms.clear()
rounds.clear()
wall: dict[str, float] = collections.defaultdict(float)
tokens: collections.Counter = collections.Counter()
for i, (_, prompt) in enumerate(labelled):
    for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
        current[0] = name
        t0 = time.perf_counter()
        tokens[name] += len(engines[name].generate([prompt], params)[0].output_ids)
        wall[name] += time.perf_counter() - t0
out: dict = {"cpu": cpu_signature(), "prompts": N, "by_engine": {}}
for name, engine in engines.items():
    n = rounds[name]
    ms = {p: round(phase_s[(name, p)] * 1e3 / n, 3) for p in ("round", "schedule", "verify_round", "commit",
                                                               "feed_drafter")}
    ms["draft"] = round(ms["round"] - sum(ms[p] for p in ("schedule", "verify_round", "commit", "feed_drafter")), 3)
    runner_id = id(engine.runner)
    entry = {"tok_s": round(tokens[name] / wall[name], 1), "rounds": n, "ms_per_round": ms,
             "forward_ms_by_tokens": {t: {"n": len(v), "median": round(statistics.median(v), 2)}
                                      for (rid, t), v in sorted(forward_ms.items())
                                      if rid == runner_id and len(v) >= 5}}
    if name != BASE:
        steps = [s for s in engine.stats if s.num_requests == 1 and s.lengths]
        entry["verified_lengths"] = dict(sorted(collections.Counter(s.lengths[0] for s in steps).items()))
        entry["accepted_when_verified"] = dict(sorted(collections.Counter(
            s.num_accepted[0] for s in steps if s.lengths[0] > 0).items()))
        by_source: dict[str, list[float]] = collections.defaultdict(list)
        for s in steps:
            by_source[(s.sources or [""])[0] or "none"].append(s.draft_ms)
        entry["draft_ms_by_source"] = {k: {"n": len(v), "median": round(statistics.median(v), 3),
                                           "max": round(max(v), 2)} for k, v in sorted(by_source.items())}
    out["by_engine"][name] = entry
out["hybrid_over_target_only"] = round(out["by_engine"]["hybrid"]["tok_s"] / out["by_engine"][BASE]["tok_s"], 3)
print(json.dumps(out))
