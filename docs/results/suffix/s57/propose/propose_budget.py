"""Session 57: the proposal budget on recorded rounds (`record_rounds.py`), one hybrid drafter in its own process
(DSpark out, as the gate leaves it on a Zen 4): per round of 32, the whole `propose` and its `propose_batch` (the native
call and its argument set-up), hot (the round's previous proposal just made) and cold (256 MB read first), and the
verdict (`feedback`, every request 1 verified 1 accepted). Medians in ms; one JSON line.
    .venv/bin/python docs/results/suffix/s57/propose/propose_budget.py ROUNDS"""

from __future__ import annotations

import json
import pickle
import statistics
import sys
import time

import numpy as np
import torch

from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.registry import make_drafter
from dspark.models.drafters.suffix import drafter as suffix_drafter
from dspark.models.target.loader import load_target

ROUNDS = pickle.load(open(sys.argv[1], "rb"))
torch.set_num_threads(2)
drafter = make_drafter("hybrid", load_target(dtype="bf16"))
for rid in {r[0] for rnd in ROUNDS for r in rnd}:
    drafter.forgo_features(rid)
native_s = [0.0]
propose_batch = suffix_drafter.propose_batch


def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - propose_batch's own signature
    t0 = time.perf_counter()
    out = propose_batch(*args, **kwargs)
    native_s[0] += time.perf_counter() - t0
    return out


suffix_drafter.propose_batch = timed
batches = [[DraftRequest(rid, toks, 0.0, tenant) for rid, toks, tenant in rnd] for rnd in ROUNDS]
sweep = np.ones(2**26, dtype=np.float32)
result: dict = {"cpu": cpu_signature(), "requests": len(ROUNDS[0]), "rounds": len(ROUNDS)}
for mode in ("hot", "cold"):
    total, native, verdict = [], [], []
    for reqs in batches:
        ids = [r.request_id for r in reqs]
        drafter.propose(reqs, 7)
        drafter.feedback(ids, [0] * len(ids), [0] * len(ids))
        if mode == "cold":
            sweep.sum()
        native_s[0] = 0.0
        t0 = time.perf_counter()
        drafter.propose(reqs, 7)
        t1 = time.perf_counter()
        drafter.feedback(ids, [1] * len(ids), [1] * len(ids))
        t2 = time.perf_counter()
        total.append((t1 - t0) * 1e3)
        native.append(native_s[0] * 1e3)
        verdict.append((t2 - t1) * 1e3)
    result[mode] = {"propose_ms": round(statistics.median(total), 3),
                    "propose_batch_ms": round(statistics.median(native), 3),
                    "feedback_ms": round(statistics.median(verdict), 3)}
print(json.dumps(result))
