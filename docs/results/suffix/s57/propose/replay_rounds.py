"""Session 57: the hybrid's whole proposal round (`HybridDrafter.propose`, Python around the native call included)
replayed on recorded rounds (`record_rounds.py`), DSpark out (its features forgone, as the gate leaves it on a
Zen 4), each round followed by an all-zero verdict. Per temperature (0 and 1: the same contexts drawn from q):
the median ms a round hot (the round again at once) and cold (256 MB read before it, as a forward leaves the
caches). With PROFILE=1, a cProfile of the hot greedy rounds instead (top 25 by own time). One JSON line.
    .venv/bin/python docs/results/suffix/s57/propose/replay_rounds.py ROUNDS [PASSES]"""

from __future__ import annotations

import cProfile
import json
import os
import pickle
import pstats
import statistics
import sys
import time

import numpy as np
import torch

from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.registry import make_drafter
from dspark.models.target.loader import load_target

ROUNDS = pickle.load(open(sys.argv[1], "rb"))
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_num_threads(2)
drafter = make_drafter("hybrid", load_target(dtype="bf16"))
for rid in {r[0] for rnd in ROUNDS for r in rnd}:
    drafter.forgo_features(rid)
sweep = np.ones(2**26, dtype=np.float32)


def requests(rnd: list, temperature: float) -> list[DraftRequest]:
    return [DraftRequest(rid, toks, temperature, tenant) for rid, toks, tenant in rnd]


def one(reqs: list[DraftRequest]) -> float:
    t0 = time.perf_counter()
    drafter.propose(reqs, 7)
    ms = (time.perf_counter() - t0) * 1e3
    drafter.feedback([r.request_id for r in reqs], [0] * len(reqs), [0] * len(reqs))
    return ms


if os.environ.get("PROFILE"):
    batches = [requests(r, 0.0) for r in ROUNDS]
    for reqs in batches:
        one(reqs)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(PASSES):
        for reqs in batches:
            one(reqs)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    sys.exit(0)

result: dict = {"cpu": cpu_signature(), "requests": len(ROUNDS[0]), "rounds": len(ROUNDS)}
for temperature in (0.0, 1.0):
    hot, cold = [], []
    batches = [requests(r, temperature) for r in ROUNDS]
    for reqs in batches:  # warm-up: the texts synced once, the tables read
        one(reqs)
    for _ in range(PASSES):
        for reqs in batches:
            sweep.sum()
            cold.append(one(reqs))
            hot.append(one(reqs))
    result[f"t{temperature:g}"] = {"hot_ms": round(statistics.median(hot), 3),
                                   "cold_ms": round(statistics.median(cold), 3)}
print(json.dumps(result))
