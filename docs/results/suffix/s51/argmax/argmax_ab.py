"""Session 51: greedy acceptance's argmax in one native pass (`native.argmax_rows`) against torch.max(dim=-1), side by
side in one process: target-only and the hybrid (Algorithm 1, the draft gate on, the shipped profile), each with
either argmax (`*-torch`, `*-native`), each engine's steps pinned to its argmax. At batch B, WAVES x B mixed prompts
through B slots, arms in turn, ROUNDS rounds (`run_refilled_in_turn`); greedy, 128 tokens; outputs compared across
the four arms. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s51/argmax/argmax_ab.py [BATCH,...] [ROUNDS] > argmax_ab.json"""

from __future__ import annotations

import json
import sys

import torch

from dspark.bench.decode import BASE, _engine, mixed_frame, run_refilled_in_turn
from dspark.kernels import native
from dspark.kernels.machine import cpu_signature
from dspark.verify_service.engine import Engine

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "8,32").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
waves, max_new = 4, 128
fast = native.argmax_rows
target, labelled, max_len = mixed_frame(max(batches) * waves, max_new)
prompts = [p for _, p in labelled]


def pinned(engine: Engine, use_native: bool) -> Engine:
    step = engine.step

    def run(*args, **kwargs):
        native.argmax_rows = fast if use_native else (lambda x: x.max(dim=-1).indices)
        return step(*args, **kwargs)

    engine.step = run  # type: ignore[method-assign]
    return engine


out: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "threads": torch.get_num_threads(),
             "by_batch": {}}
for bs in batches:
    engines = {name: pinned(_engine(kind, target, bs, max_len, "greedy", 7, None, True, {}), nat)
               for name, kind, nat in ((BASE, BASE, False), ("target-native", BASE, True),
                                       ("hybrid-torch", "hybrid", False), ("hybrid-native", "hybrid", True))}
    arms, per_round = run_refilled_in_turn(engines, prompts[:bs * waves], bs, max_new, rounds)
    tok = {n: a.tok_s for n, a in arms.items()}
    res = {"tok_s": {n: round(v, 1) for n, v in tok.items()},
           "native_over_torch": {"target": round(tok["target-native"] / tok[BASE], 3),
                                 "hybrid": round(tok["hybrid-native"] / tok["hybrid-torch"], 3)},
           "hybrid_over_target": {"torch": round(tok["hybrid-torch"] / tok[BASE], 3),
                                  "native": round(tok["hybrid-native"] / tok["target-native"], 3)},
           "per_round_tok_s": {n: [round(v, 1) for v in r] for n, r in per_round.items()},
           "greedy_identical_across_arms": all(a.outputs == arms[BASE].outputs for a in arms.values())}
    out["by_batch"][bs] = res
    print(json.dumps({bs: res}), file=sys.stderr, flush=True)
native.argmax_rows = fast
print(json.dumps(out))
