"""Session 56: the suffix kernels of a base commit against this checkout's on REAL decoding contexts. s54's
`propose_ab.py` grows eval prompts by filler tokens, so 78 % of its corpus walks match nothing (all of 2..8 fail);
here the contexts are what the hybrid proposes on while it decodes: B mixed eval prompts decoded 128 tokens through B
slots by the hybrid (Algorithm 1 without the draft gate, so every step proposes; greedy) on this checkout's kernels,
every proposal round's requests recorded, then replayed on either build in alternating order, 256 MB read before
every round (a forward leaves the caches so), each round's walks compared bit for bit. Median ms a round; the matched
context lengths of the corpus walks. One JSON line.
    .venv/bin/python docs/results/suffix/s56/propose/propose_ab_real.py [BASE_COMMIT] [B]"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time

import numpy as np

from dspark.bench.decode import _engine, mixed_frame
from dspark.bench.kernel_ab import kernel_libraries, use_library
from dspark.kernels import suffix_native
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.verify_service.request import SamplingParams

BASE = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 32
libs = kernel_libraries(BASE, module=suffix_native)


def use(name: str) -> None:
    use_library(libs, name, module=suffix_native)


use("head")
target, labelled, max_len = mixed_frame(B, 128)
engine = _engine("hybrid", target, B, max_len, "greedy", 7, None, False, {})  # no gate: every step proposes
drafter = engine.drafter
rounds: list[list[DraftRequest]] = []
propose = drafter.propose


def recording(requests, max_num_tokens):  # noqa: ANN001, ANN202 - the drafter's own signature
    rounds.append([DraftRequest(r.request_id, list(r.token_ids), r.temperature, r.tenant) for r in requests])
    return propose(requests, max_num_tokens)


drafter.propose = recording
engine.generate([p for _, p in labelled], SamplingParams(max_tokens=128, ignore_eos=True))
drafter.propose = propose
rounds = [r for r in rounds if len(r) == B]  # the full rounds (the tail's shrinking batches left out)
ids = sorted({r.request_id for rnd in rounds for r in rnd})
for rid in ids:
    drafter.forgo_features(rid)
sweep = np.ones(2**26, dtype=np.float32)
times: dict[str, list[float]] = {n: [] for n in libs}
matched: collections.Counter = collections.Counter()
identical = True
for k, reqs in enumerate(rounds * 2):
    walks = {}
    for name in (["base", "head"] if k % 2 == 0 else ["head", "base"]):
        use(name)
        sweep.sum()
        t0 = time.perf_counter()
        out = drafter.propose(reqs, 7)
        times[name].append((time.perf_counter() - t0) * 1e3)
        batch = drafter.suffix._batch
        walks[name] = [(w.tokens, w.freq, w.count, w.match, w.conf)
                       for w in batch.walks([r for r in range(len(reqs)) for _ in range(3)], [0, 1, 2] * len(reqs))]
        walks[name + "_out"] = out.tokens
        drafter.feedback([r.request_id for r in reqs], [0] * len(reqs), [0] * len(reqs))
    identical &= walks["base"] == walks["head"] and walks["base_out"] == walks["head_out"]
    if k < len(rounds):
        matched.update(w[3][0] if w[0] else 0 for w in walks["head"][1::3])
med = {n: statistics.median(v) for n, v in times.items()}
total = sum(matched.values())
print(json.dumps({"cpu": cpu_signature(), "base": BASE, "requests": B, "rounds": len(rounds) * 2,
                  **{f"{n}_ms": round(v, 3) for n, v in med.items()},
                  "head_over_base": round(med["head"] / med["base"], 3), "walks_identical": identical,
                  "corpus_match_len_share": {k: round(v / total, 3) for k, v in sorted(matched.items())}}))
