"""Session 55: the survival the proposals carried against the same with a per-request online log-odds shift
(b_r += eta (y - c') after each verdict of request r, over its trials, as the live per-source shift learns but per
request), on collect.py's uncensored rounds. Prints per estimator: log-loss of the conditional trials, and the
frontier "accepted drafts vs verified drafts" when each round verifies its prefix while the estimated prefix
survival >= theta (theta swept): accepted at the verified-draft counts of the shipped estimator's thetas.
    .venv/bin/python docs/results/suffix/s55/request_bias/analyse.py ROUNDS.jsonl[.gz]
(rounds_t0.jsonl.gz: collect.py's 4,838 rounds of 96 held-out prompts at T = 0; analyse_t0.json: this on them)"""

from __future__ import annotations

import gzip
import json
import math
import sys

import numpy as np

rows = [json.loads(line) for line in (gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt")]


def logit(p: float) -> float:
    p = min(1 - 1e-6, max(1e-6, p))
    return math.log(p / (1 - p))


def sig(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def estimates(eta: float, per_source: bool, decay: float = 1.0) -> list[list[float]]:
    """Per round, the conditionals under a per-request shift learned from that request's earlier rounds only."""
    bias: dict = {}
    out = []
    for r in rows:
        key = (r["rid"], r["source"]) if per_source else r["rid"]
        b = bias.get(key, 0.0)
        c = [sig(logit(x) + b) for x in r["c"]]
        out.append(c)
        trials = min(r["v"], r["a"] + 1, len(c))
        for k in range(trials):
            b = decay * b + eta * (float(k < r["a"]) - c[k])
        bias[key] = max(-3.0, min(3.0, b))
    return out


def logloss(cs: list[list[float]]) -> float:
    tot = n = 0
    for r, c in zip(rows, cs):
        for k in range(min(r["v"], r["a"] + 1, len(c))):
            y = k < r["a"]
            p = min(1 - 1e-6, max(1e-6, c[k]))
            tot -= math.log(p if y else 1 - p)
            n += 1
    return tot / n


def frontier(cs: list[list[float]], thetas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ver, acc = np.zeros(len(thetas)), np.zeros(len(thetas))
    for r, c in zip(rows, cs):
        surv = np.cumprod(c[:r["v"]])
        for i, th in enumerate(thetas):
            n = int(np.sum(np.cumprod(surv >= th)))  # the prefix while survival >= theta
            ver[i] += n
            acc[i] += min(n, r["a"])
    return ver, acc


thetas = np.linspace(0.05, 0.95, 19)
base = [r["c"] for r in rows]
bv, ba = frontier(base, thetas)
res = {"rounds": len(rows), "requests": len({r["rid"] for r in rows}),
       "shipped": {"logloss": round(logloss(base), 4)}}
for eta in (0.05, 0.1, 0.2, 0.4):
    for per_source in (False, True):
        for decay in (1.0, 0.9):
            cs = estimates(eta, per_source, decay)
            v, a = frontier(cs, thetas)
            # accepted at the shipped estimator's verified counts (linear interpolation on this frontier)
            order = np.argsort(v)
            at = np.interp(bv, v[order], a[order])
            res[f"eta={eta} per_source={per_source} decay={decay}"] = {
                "logloss": round(logloss(cs), 4),
                "accepted_ratio_at_equal_verified": [round(x, 3) for x in (at / np.maximum(ba, 1))[::3]]}
res["shipped"]["verified_per_round"] = [round(x, 2) for x in (bv / len(rows))[::3]]
res["shipped"]["accepted_per_round"] = [round(x, 2) for x in (ba / len(rows))[::3]]
print(json.dumps(res, indent=1))
