"""Session 57: what verifying BOTH cheap sources' drafts in one forward (a two-branch tree) could add over verifying
the chosen one, offline at T = 0, as `dspark eval` counts τ. N mixed eval prompts (evaluation only), the target's greedy
continuation of 128 tokens each (target-only engine); then per prompt two simulated decodings against it: "chosen"
verifies the suffix drafter's chosen proposal (γ = 7, the request and corpus sources, calibration as shipped and
frozen, no served text), "tree" verifies both sources' walks and keeps the longer accepted one. Per step τ = accepted
+ 1; rows = draft tokens verified (the tree: both walks' tokens, their common prefix once). All drafts verified whole
(an upper bound on rows: the prefix scheduler verifies less). Per dataset and overall: τ and rows a step. One JSON line.
    .venv/bin/python docs/results/suffix/s57/tree/tree_bound.py [N]"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.suffix.drafter import DEFAULT_SUFFIX_DIR, SuffixDrafter
from dspark.verify_service.request import SamplingParams

N = int(sys.argv[1]) if len(sys.argv) > 1 else 40
GAMMA, NEW = 7, 128
target, labelled, max_len = mixed_frame(N, NEW)
engine = _engine(BASE, target, 8, max_len, "greedy", 0, None, False, {})
greedy = [o.output_ids for o in engine.generate([p for _, p in labelled],
                                                 SamplingParams(max_tokens=NEW, ignore_eos=True))]
drafter = SuffixDrafter.from_pretrained(DEFAULT_SUFFIX_DIR, sources=["request", "corpus"], live_calibration=False,
                                        live_bias_rate=0.0)


def accepted(walk: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(walk) and n < len(truth) and walk[n] == truth[n]:
        n += 1
    return n


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


stats: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
for i, ((dataset, prompt), out) in enumerate(zip(labelled, greedy)):
    for mode in ("chosen", "tree"):
        p = 0
        while p < len(out) - 1:
            k = min(GAMMA, len(out) - 1 - p)
            req = DraftRequest(f"{mode}-{i}", prompt + out[:p], 0.0)
            best = drafter.choose_batch([req], k)[0]
            walks = [drafter._batch.walk(0, s).tokens for s in (0, 1)]  # the request's and the corpus's own walks
            truth = out[p:p + k]
            if mode == "chosen":
                acc = accepted(best.walk.tokens, truth) if best is not None else 0
                rows = len(best.walk.tokens) if best is not None else 0
            else:
                acc = max(accepted(w, truth) for w in walks)
                rows = len(walks[0]) + len(walks[1]) - common(walks[0], walks[1])
            for key in (dataset, "all"):
                stats[key][f"{mode}_tau"].append(acc + 1)
                stats[key][f"{mode}_rows"].append(rows)
            p += acc + 1
        drafter.release(f"{mode}-{i}")
summary = {key: {m: round(statistics.fmean(v), 3) for m, v in by.items()} for key, by in stats.items()}
print(json.dumps({"cpu": cpu_signature(), "prompts": N, "gamma": GAMMA, "new_tokens": NEW, **summary}))
