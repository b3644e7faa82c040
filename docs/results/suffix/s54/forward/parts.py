"""Session 54: where a bf16 verify forward's time goes by shape (R requests x L tokens each, 300 cached tokens a slot,
as s52/gemm/gemm_ab.py's forward part): N forwards per shape under cProfile, own time per native wrapper (the C call
is inside it) and the rest. 2 threads. Prints one JSON line: per shape ms per forward for each part.
    .venv/bin/python docs/results/suffix/s54/forward/parts.py [R,L;R,L;...] [N]"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time

import torch

from dspark.kernels.machine import cpu_signature
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
SHAPES = [tuple(int(x) for x in s.split(",")) for s in
          (sys.argv[1] if len(sys.argv) > 1 else "1,1;1,8;4,3;8,1;8,2;16,1;32,1").split(";")]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 30
PARTS = ("_gemm", "attention", "_norm_bf16", "_silu_mul_bf16", "rotary_cache_write", "argmax_rows")
target = load_target(dtype="bf16")
runner = TargetRunner(target.model, 32, 1024)
slots = [runner.cache.allocate() for _ in range(32)]
gen = torch.Generator().manual_seed(0)
ctxs = [torch.randint(4, 40000, (300,), generator=gen).tolist() for _ in range(32)]
result: dict = {"cpu": cpu_signature(), "forwards": N, "shapes": []}
with torch.inference_mode():
    for s, c in zip(slots, ctxs):
        runner.forward([SeqChunk(s, 0, c, 1)])
    for R, L in SHAPES:
        chunks = [SeqChunk(slots[i], 300, ctxs[i][:L], L) for i in range(R)]
        for _ in range(3):
            runner.forward(chunks)
        t0 = time.perf_counter()
        for _ in range(N):
            runner.forward(chunks)
        wall = (time.perf_counter() - t0) * 1e3 / N
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(N):
            runner.forward(chunks)
        prof.disable()
        st = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
        own = {p: 0.0 for p in PARTS}
        for (_, _, name), (_, _, tt, _, _) in st.items():
            if name in own:
                own[name] += tt * 1e3 / N
        row = {"requests": R, "tokens_each": L, "wall_ms": round(wall, 2),
               **{p.strip("_"): round(v, 2) for p, v in own.items()},
               "rest_ms_under_profiler": round(sum(v[2] for v in st.values()) * 1e3 / N - sum(own.values()), 2)}
        result["shapes"].append(row)
        print(row, file=sys.stderr, flush=True)
print(json.dumps(result))
