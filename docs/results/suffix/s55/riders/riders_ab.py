"""Session 55: how a round that carries prompts (riders) should price its verified drafts. Until session 55 the
scheduler of such a round read the SPS table shifted by the riders' tokens (T(P + n), `with_base_tokens`: the step
is long anyway, so a verified token costs a small share of it) and verified much more there. Arms, one process,
taking turns run by run over ROUNDS runs: target-only, the hybrid on that shifted table ("shifted"), the hybrid as
shipped since (`SPSTable.with_riders`: T(r) + T(P + n) - T(P + r), "priced") and, with --plain, the hybrid whose
rider rounds read the plain table T(n) ("plain", the first variant tried). B slots, 4 x B mixed eval prompts,
refilled (continuous batching), 128 tokens, greedy; the prefix cache off so every run prefills its prompts as new
traffic does. Per arm and run: wall, forwards with and without riders and their seconds, verified and accepted
drafts per request.
    .venv/bin/python docs/results/suffix/s55/riders/riders_ab.py B [ROUNDS] [--plain]
riders_ab_b8_plain.json: the first A/B (before `with_riders`; its "base" is "shifted" here)."""

from __future__ import annotations

import json
import sys
import time

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.spec.sps import SPSTable
from dspark.verify_service.request import SamplingParams

B = int(sys.argv[1])
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 3
target, labelled, max_len = mixed_frame(4 * B, 128)
prompts = [p for _, p in labelled]


class PlainTable(SPSTable):
    """The table a rider round reads as it is (no shift by the riders' tokens)."""

    def with_riders(self, prompt_tokens: int, num_requests: int) -> SPSTable:
        return self


class ShiftedTable(SPSTable):
    """Until session 55: a rider round's table is T(P + n) (the old `with_base_tokens`)."""

    def with_riders(self, prompt_tokens: int, num_requests: int) -> SPSTable:
        xs = [1] + [x - prompt_tokens for x in self.tokens_per_step if x - prompt_tokens > 1]
        if len(xs) == 1:
            xs.append(2)
        return SPSTable(xs, [self.step_time_ms_at(x + prompt_tokens) for x in xs], dict(self.meta))


ARMS = [(BASE, BASE), ("shifted", "hybrid"), ("priced", "hybrid")] + ([("plain", "hybrid")] if "--plain" in sys.argv
                                                                    else [])
engines = {name: _engine(kind, target, B, max_len + 8, "greedy", 7, None, True, {}) for name, kind in ARMS}
for name, cls in (("shifted", ShiftedTable), ("plain", PlainTable)):
    if name in engines:
        p = engines[name].sps
        engines[name].sps = cls(p.tokens_per_step, p.step_time_ms, p.meta)
forwards: dict[str, list[tuple[bool, float]]] = {n: [] for n in engines}
for name, engine in engines.items():
    engine.prefix_cache = None
    inner = engine.runner.forward

    def timed(chunks, *a, _f=inner, _n=name, **k):
        t0 = time.perf_counter()
        out = _f(chunks, *a, **k)
        forwards[_n].append((max(len(c.token_ids) for c in chunks) > 8, time.perf_counter() - t0))
        return out

    engine.runner.forward = timed
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True, tenant="warm-up"))
res: dict = {"cpu": cpu_signature(), "batch": B, "prompts": len(prompts), "arms": {n: [] for n in engines}}
outs: dict[str, list] = {}
for r in range(ROUNDS):
    order = list(engines)[r % len(engines):] + list(engines)[:r % len(engines)]
    for name in order:
        engine = engines[name]
        forwards[name].clear()
        n0 = len(engine.stats)
        t0 = time.perf_counter()
        done = engine.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True,
                                                       tenant=f"round-{r}"))
        wall = time.perf_counter() - t0
        outs.setdefault(name, [d.output_ids for d in done])
        st = engine.stats[n0:]
        rider = [f for f in forwards[name] if f[0]]
        plain = [f for f in forwards[name] if not f[0]]
        res["arms"][name].append({
            "wall_s": round(wall, 3), "steps": len(st),
            "plain_forwards": len(plain), "plain_s": round(sum(f[1] for f in plain), 3),
            "rider_forwards": len(rider), "rider_s": round(sum(f[1] for f in rider), 3),
            "verified_per_request": round(sum(sum(s.lengths) for s in st) / max(1, sum(s.num_requests for s in st)), 3),
            "accepted_per_request": round(sum(sum(s.num_accepted) for s in st) /
                                          max(1, sum(s.num_requests for s in st)), 3)})
        print(name, r, res["arms"][name][-1], file=sys.stderr, flush=True)
base_wall = [a["wall_s"] for a in res["arms"][BASE]]
for name in [n for n in engines if n != BASE]:
    res[f"{name}_speedup_by_round"] = [round(b / a["wall_s"], 3) for b, a in zip(base_wall, res["arms"][name])]
    res[f"{name}_speedup"] = round(sum(base_wall) / sum(a["wall_s"] for a in res["arms"][name]), 3)
    res[f"{name}_greedy_identical"] = outs[name] == outs[BASE]
print(json.dumps(res))
