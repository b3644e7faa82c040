"""Session 51: the native bf16 passes (the residual add and RMSNorm in one, SiLU·up in one; PyTorch's results to the
bit) against PyTorch's ops, side by side in one process. Four engines: target-only and the hybrid (Algorithm 1, the
draft gate on, the shipped profile), each on PyTorch's ops (`target-only`, `hybrid-torch`) and on the native passes
(`target-native`, `hybrid-native`); each engine's forwards pinned to its ops (NATIVE=norms: the norms alone, as
`norm_ab_norms_5c35b2e.json` was made). Batch 1:
NUM mixed prompts, the arms in turn on each prompt (`run_interleaved`); batch B > 1: WAVES x B prompts through B
slots, arm by arm in turn, ROUNDS rounds (`run_refilled_in_turn`). Greedy, 128 tokens; outputs compared across
the four arms. Prints one JSON line: tok/s per arm and the ratios that matter (hybrid / target-only with the same
norms, native / torch for each).
    .venv/bin/python docs/results/suffix/s51/norms/norm_ab.py [BATCH,...] [ROUNDS] > norm_ab.json"""

from __future__ import annotations

import json
import os
import sys

from dspark.bench.decode import BASE, _engine, mixed_frame, run_interleaved, run_refilled_in_turn
from dspark.kernels import native
from dspark.kernels.machine import cpu_signature

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,4,8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
waves, max_new, num_b1 = 4, 128, 24
lanes, table = native.bf16_norm_lanes(), native.silu_bf16_table()
assert lanes is not None and table is not None, "no native bf16 norm or SiLU on this machine"
norms_only = os.environ.get("NATIVE") == "norms"
on, off = (native.bf16_norm_lanes, native.silu_bf16_table), (lambda: None, lambda: None)
target, labelled, max_len = mixed_frame(max(num_b1, max(batches) * waves), max_new)
prompts = [p for _, p in labelled]


def pinned(engine, use_native: bool):
    forward = engine.runner.forward

    def run(*args, **kwargs):
        native.bf16_norm_lanes = (on if use_native else off)[0]
        native.silu_bf16_table = (on if use_native and not norms_only else off)[1]
        return forward(*args, **kwargs)

    engine.runner.forward = run
    return engine


out: dict = {"cpu": cpu_signature(), "sum_lanes": lanes, "rounds": rounds, "waves": waves, "by_batch": {}}
for bs in batches:
    engines = {name: pinned(_engine(kind, target, bs, max_len, "greedy", 7, None, True, {}), nat)
               for name, kind, nat in ((BASE, BASE, False), ("target-native", BASE, True),
                                       ("hybrid-torch", "hybrid", False), ("hybrid-native", "hybrid", True))}
    if bs == 1:
        arms = run_interleaved(engines, prompts[:num_b1], max_new, rounds)
        per_round = None
    else:
        arms, per_round = run_refilled_in_turn(engines, prompts[:bs * waves], bs, max_new, rounds)
    tok = {n: a.tok_s for n, a in arms.items()}
    steady = {n: a.steady_tok_s for n, a in arms.items()}
    same = all(a.outputs == arms[BASE].outputs for a in arms.values())
    res = {"tok_s": {n: round(v, 1) for n, v in tok.items()},
           "tau": {n: round(a.tau, 3) for n, a in arms.items()},
           "hybrid_over_target": {"torch": round(tok["hybrid-torch"] / tok[BASE], 3),
                                  "native": round(tok["hybrid-native"] / tok["target-native"], 3)},
           "native_over_torch": {"target": round(tok["target-native"] / tok[BASE], 3),
                                 "hybrid": round(tok["hybrid-native"] / tok["hybrid-torch"], 3)},
           "greedy_identical_across_arms": same}
    if per_round:
        res["per_round_tok_s"] = {n: [round(v, 1) for v in r] for n, r in per_round.items()}
        if all(steady.values()):
            res["steady_hybrid_over_target"] = {"torch": round(steady["hybrid-torch"] / steady[BASE], 3),
                                                "native": round(steady["hybrid-native"] / steady["target-native"], 3)}
    out["by_batch"][bs] = res
    print(json.dumps({bs: res}), file=sys.stderr, flush=True)
native.bf16_norm_lanes, native.silu_bf16_table = on
out["native"] = "norms" if norms_only else "norms and SiLU·up"
print(json.dumps(out))
