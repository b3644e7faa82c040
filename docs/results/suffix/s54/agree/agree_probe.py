"""Session 54: does the other source's agreement tell a draft token's survival beyond its calibrated c_k? The hybrid
(request and corpus sources, no DSpark, no served text) drafts NUM mixed prompts at batch 1, greedy, 128 tokens,
every draft verified in full (the fixed scheduler, k = 7). Per chosen proposal and position k reached (every earlier
token accepted): its calibrated conditional survival c_k, whether the other source's walk of the same round has the
same first k + 1 tokens, and whether the token was accepted. Prints one JSON line: per (source, agree, c_k decile)
the count, the mean predicted c_k and the observed acceptance.
    .venv/bin/python docs/results/suffix/s54/agree/agree_probe.py [NUM]"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import mixed_frame
from dspark.config.engine import EngineConfig
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.hybrid import HybridDrafter
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

num = int(sys.argv[1]) if len(sys.argv) > 1 else 24
target, labelled, max_len = mixed_frame(num, 128)
drafter = HybridDrafter.build(target, use_model=False, sources=["request", "corpus"])
engine = Engine(EngineConfig(target=target.name, drafter="hybrid", scheduler="fixed", scheduler_kwargs={"k": 7},
                             num_draft_tokens=7, max_num_seqs=1, max_model_len=max_len + 8, draft_gate=False),
                target=target, drafter=drafter)
suffix = drafter.suffix
names = ("request", "corpus", "served")
pending: dict[str, tuple[list[float], list[bool]]] = {}
rows: list[tuple[bool, float, bool, str]] = []  # (agree, predicted c_k, accepted, source)
propose, feedback = drafter.propose, drafter.feedback


def propose_hook(requests, max_num_tokens):  # noqa: ANN001, ANN202
    out = propose(requests, max_num_tokens)
    batch = suffix._batch
    for r, req in enumerate(requests):
        if not out.tokens[r]:
            continue
        mine = out.sources[r]
        other = [batch.walk(r, s).tokens for s, n in enumerate(names) if n != mine and batch.k[r, s] > 0]
        agree = [any(o[:k + 1] == out.tokens[r][:k + 1] for o in other) for k in range(len(out.tokens[r]))]
        surv = list(out.confidences[r])  # conditional c_k: a reached position's outcome
        pending[req.request_id] = (surv, agree, mine)
    return out


def feedback_hook(request_ids, num_verified, num_accepted):  # noqa: ANN001, ANN202
    for rid, n_ver, n_acc in zip(request_ids, num_verified, num_accepted):
        got = pending.pop(rid, None)
        if got is None:
            continue
        surv, agree, src = got
        for k in range(min(n_ver, n_acc + 1)):  # positions past the first rejection have no outcome of their own
            rows.append((agree[k], surv[k], k < n_acc, src))
    feedback(request_ids, num_verified, num_accepted)


drafter.propose, drafter.feedback = propose_hook, feedback_hook
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
for _, prompt in labelled:
    engine.generate([prompt], params)
cells: dict = {}
for agree, s, acc, src in rows:
    key = f"{src}|{'agree' if agree else 'alone'}|{min(int(s * 10), 9)}"
    c = cells.setdefault(key, [0, 0.0, 0])
    c[0], c[1], c[2] = c[0] + 1, c[1] + s, c[2] + acc
print(json.dumps({"cpu": cpu_signature(), "prompts": num, "positions": len(rows),
                  "cells": {k: {"n": n, "predicted": round(p / n, 3), "accepted": round(a / n, 3)}
                            for k, (n, p, a) in sorted(cells.items())}}))
