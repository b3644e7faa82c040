"""Session 60: what verifying BOTH cheap sources' drafts each round (a two-branch tree) could add at batch 1, offline.
The target's greedy continuation of 128 tokens for N mixed eval prompts (target-only engine; evaluation only), then a
batch-1 decoding that verifies whole drafts replayed on it: at each round the suffix drafter's chosen proposal (γ 7,
the request and corpus sources, the shipped calibration frozen, no served text) and both sources' walks; counted: the
accepted tokens of the chosen draft, of the better of the two walks (what a tree of both would accept), the rounds
whose chosen draft failed at its first token and how many of those the other walk would have saved. Per set too.
One JSON line.
    .venv/bin/python docs/results/suffix/s60/two_sources/two_source_bound.py [N] > two_source_bound.json"""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.suffix.drafter import DEFAULT_SUFFIX_DIR, SuffixDrafter
from dspark.verify_service.request import SamplingParams

N = int(sys.argv[1]) if len(sys.argv) > 1 else 24
NEW, GAMMA = 128, 7
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


total = {"rounds": 0, "accepted_chosen": 0, "accepted_better_of_two": 0, "chosen_failed_first": 0,
         "of_which_other_walk_accepted": 0, "first_tokens_differ": 0}
by_set: dict[str, dict[str, int]] = {}
for i, ((dataset, prompt), out) in enumerate(zip(labelled, greedy)):
    p = 0
    while p < len(out) - 1:
        k = min(GAMMA, len(out) - 1 - p)
        best = drafter.choose_batch([DraftRequest(f"r{i}", prompt + out[:p], 0.0)], k)[0]
        if best is None:
            p += 1
            continue
        truth = out[p:p + k]
        walks = [drafter._batch.walk(0, s).tokens for s in (0, 1)]
        a, m = accepted(best.walk.tokens, truth), max(accepted(w, truth) for w in walks)
        s = by_set.setdefault(dataset, {"rounds": 0, "accepted_chosen": 0, "accepted_better_of_two": 0})
        for d in (total, s):
            d["rounds"] += 1
            d["accepted_chosen"] += a
            d["accepted_better_of_two"] += m
        total["first_tokens_differ"] += int(bool(walks[0]) and bool(walks[1]) and walks[0][0] != walks[1][0])
        if a == 0:
            total["chosen_failed_first"] += 1
            total["of_which_other_walk_accepted"] += int(m > 0)
        p += a + 1
    drafter.release(f"r{i}")
print(json.dumps({"cpu": cpu_signature(), "prompts": N, **total,
                  "per_round": {"chosen": round(total["accepted_chosen"] / total["rounds"], 3),
                                "better_of_two": round(total["accepted_better_of_two"] / total["rounds"], 3)},
                  "by_set": {d: {**v, "per_round_chosen": round(v["accepted_chosen"] / v["rounds"], 3),
                                 "per_round_better_of_two": round(v["accepted_better_of_two"] / v["rounds"], 3)}
                             for d, v in by_set.items()}}))
