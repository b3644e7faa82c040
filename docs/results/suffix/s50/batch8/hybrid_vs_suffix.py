"""Session 50: at batch 8, is the hybrid anything but its cheap sources? Target-only, the hybrid and the suffix
sources alone (Algorithm 1, the draft gate on), 32 mixed prompts through 8 slots, ROUNDS rounds in turn
(`run_refilled_in_turn`); per arm tok/s, by-round ratio to target-only, τ, tokens verified a request, and at the
steps with 8 requests the mean drafting / scheduling / verify ms, tokens through the target and proposals per
source; the hybrid's DSpark account (`_value_ms`: what DSpark's rounds were worth, its features gate). One JSON line.
    .venv/bin/python docs/results/suffix/s50/batch8/hybrid_vs_suffix.py [ROUNDS] > hybrid_vs_suffix_b8.json"""

from __future__ import annotations

import json
import statistics
import sys

from dspark.bench.decode import BASE, _engine, mixed_frame, run_refilled_in_turn
from dspark.kernels.machine import cpu_signature

BS, ROUNDS = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 2
target, labelled, max_len = mixed_frame(4 * BS, 128)
prompts = [p for _, p in labelled]
names = [BASE, "hybrid", "suffix"]
engines = {n: _engine(n, target, BS, max_len, "greedy", 7, None, True, {}) for n in names}
arms, by_round = run_refilled_in_turn(engines, prompts, BS, 128, ROUNDS)
out: dict = {"cpu": cpu_signature(), "batch": BS, "rounds": ROUNDS, "arms": {}}
for n in names:
    st = [s for s in engines[n].stats if s.num_requests == BS]
    out["arms"][n] = {
        "tok_s": round(arms[n].tok_s, 1), "by_round": [round(a / b, 3) for a, b in zip(by_round[n], by_round[BASE])],
        "tau": round(arms[n].tau, 3), "verify_len": round(arms[n].mean_verify_len, 3),
        "draft_ms": round(statistics.mean(s.draft_ms for s in st), 3),
        "schedule_ms": round(statistics.mean(s.schedule_ms for s in st), 3),
        "verify_ms": round(statistics.mean(s.verify_ms for s in st), 2),
        "tokens_a_step": round(statistics.mean(s.num_tokens for s in st), 2),
        "proposals": {k: sum((s.num_proposals or {}).get(k, 0) for s in st) for k in ("request", "corpus", "served",
                                                                                        "dspark")}}
out["hybrid_dspark_account_ms"] = round(engines["hybrid"].drafter._value_ms, 3)
print(json.dumps(out))
