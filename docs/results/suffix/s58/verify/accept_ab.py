"""Session 58: greedy acceptance on host lists (`verify_greedy`) against the tensor path it replaced on CPU (the
rows' argmax, then ~15 small tensor ops: layout, where, scatter_reduce, gather), in the engine, side by side in one
process. Four engines: target-only and the hybrid (Algorithm 1, the draft gate on), each with the old path (`tensor`:
every `generate` of the engine swaps in `verify(build_verify_input(...))`, what `accept` ran before) or the new one
(`host`). Batch 1: NUM mixed prompts, the arms in turn on each prompt; batch B > 1: 4 x B prompts through B slots,
arm by arm in turn, ROUNDS rounds (`dspark.bench.decode.change_ab`). Greedy, 128 tokens; outputs compared across the
four arms. One JSON line.
    .venv/bin/python docs/results/suffix/s58/verify/accept_ab.py [BATCH,...] [ROUNDS] > accept_ab.json"""

from __future__ import annotations

import json
import sys

import torch

from dspark.bench.decode import BASE, _engine, change_ab, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.spec.verification import VerifyInput, VerifyOutput, verify, verify_greedy
from dspark.verify_service.step import verify as verify_step

batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
waves, max_new, num_b1 = 4, 128, 24
target, labelled, max_len = mixed_frame(max(num_b1, max(batches) * waves), max_new)
prompts = [p for _, p in labelled]


def tensor_path(logits: torch.Tensor, drafts: list[list[int]], lengths: list[int]) -> VerifyOutput:
    """What `accept` ran for an all-greedy CPU batch before: `verify` on `build_verify_input`'s tensors."""
    flat: list[int] = []
    for d, n in zip(drafts, lengths):
        flat += d[:n] + [0]
    r = len(lengths)
    return verify(VerifyInput(logits, torch.tensor(flat, dtype=torch.long), None, list(lengths), [0.0] * r,
                              [1.0] * r, [None] * r))


def built(kind: str, bs: int, path) -> object:  # noqa: ANN001 - one of the two functions above
    engine = _engine(kind, target, bs, max_len, "greedy", 7, None, True, {})
    generate = engine.generate

    def on_its_path(*args, **kwargs):  # noqa: ANN202 - the engine's own signature
        verify_step.verify_greedy = path
        return generate(*args, **kwargs)

    engine.generate = on_its_path
    return engine


out: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "by_batch": {}}
for bs in batches:
    engines = {BASE: built(BASE, bs, tensor_path), "target-host": built(BASE, bs, verify_greedy),
               "hybrid-tensor": built("hybrid", bs, tensor_path), "hybrid-host": built("hybrid", bs, verify_greedy)}
    res = change_ab(engines, "tensor", "host", prompts, bs, max_new, rounds, num_b1, waves)
    out["by_batch"][bs] = res
    print(json.dumps({bs: res}), file=sys.stderr, flush=True)
print(json.dumps(out))
