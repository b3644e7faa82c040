"""Session 58: the AVX512-BF16 GEMM's k blocks (and their prefetch) from 3 rows instead of 7 (`DP_MIN_BLOCKED`), in
the engine, side by side in one process against a base commit's kernels (default 4f354ca). Four engines: target-only
and the hybrid (Algorithm 1, the draft gate on, the shipped profile), each running with the base commit's native
library (`base`) or this checkout's (`blocked3`): every `generate` of an engine first makes its library the process's
(`dspark.bench.kernel_ab.use_library`). Batch 1: 24 mixed prompts, the arms in turn on each prompt; batch B > 1:
4 x B prompts through B slots, arm by arm in turn, ROUNDS rounds (`dspark.bench.decode.change_ab`). Greedy, 128
tokens; outputs compared across the four arms. Prints one JSON line: tok/s per arm, hybrid / target-only on the same
kernels, blocked3 / base for each.
    .venv/bin/python docs/results/suffix/s58/gemm/engine_ab.py [BATCH,...] [ROUNDS] [BASE_COMMIT] > engine_ab.json"""

from __future__ import annotations

import json
import sys

import torch

from dspark.bench.decode import BASE, _engine, change_ab, mixed_frame
from dspark.bench.kernel_ab import kernel_libraries, use_library
from dspark.kernels.machine import cpu_signature

torch.set_num_threads(2)
batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,4,8").split(",")]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
base_commit = sys.argv[3] if len(sys.argv) > 3 else "4f354ca"
waves, max_new, num_b1 = 4, 128, 24
libs = kernel_libraries(base_commit)
target, labelled, max_len = mixed_frame(max(num_b1, max(batches) * waves), max_new)
prompts = [p for _, p in labelled]


def built(kind: str, bs: int, lib: str):
    """An engine whose every `generate` runs on `libs[lib]`."""
    use_library(libs, lib)
    engine = _engine(kind, target, bs, max_len, "greedy", 7, None, True, {})
    generate = engine.generate

    def on_its_library(*args, **kwargs):  # noqa: ANN202 - the engine's own signature
        use_library(libs, lib)
        return generate(*args, **kwargs)

    engine.generate = on_its_library
    return engine


out: dict = {"cpu": cpu_signature(), "base": base_commit, "rounds": rounds, "waves": waves, "by_batch": {}}
for bs in batches:
    engines = {BASE: built(BASE, bs, "base"), "target-blocked3": built(BASE, bs, "head"),
               "hybrid-base": built("hybrid", bs, "base"), "hybrid-blocked3": built("hybrid", bs, "head")}
    res = change_ab(engines, "base", "blocked3", prompts, bs, max_new, rounds, num_b1, waves)
    out["by_batch"][bs] = res
    print(json.dumps({bs: res}), file=sys.stderr, flush=True)
print(json.dumps(out))
