"""Session 51: the whole bf16 forward (`TargetRunner`, SmolLM2, 2 threads) on PyTorch's ops, with the native norms
(the residual add and RMSNorm in one pass), and with the native norms and SiLU·up, in one process: logits and
hidden states (layers 10 and 20) compared bit for bit with PyTorch's, and each variant's time at R x L tokens (R
slots of 300 cached tokens, L new tokens each), 7 turns of 5 forwards in turn, medians. Prints one JSON line.
    .venv/bin/python docs/results/suffix/s51/norms/forward_ab.py [RxL ...] > forward_ab.json"""

import json
import statistics
import sys
import time

import torch

from dspark.kernels import native
from dspark.kernels.machine import cpu_signature
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

torch.set_num_threads(2)
target = load_target(dtype="bf16")
runner = TargetRunner(target.model, 32, 512)
lanes, table = native.bf16_norm_lanes, native.silu_bf16_table
assert lanes() is not None and table() is not None
VARIANTS = {"torch": (False, False), "norms": (True, False), "norms_silu": (True, True)}


def use(variant: str) -> None:
    norms, silu = VARIANTS[variant]
    native.bf16_norm_lanes = lanes if norms else (lambda: None)
    native.silu_bf16_table = table if silu else (lambda: None)


gen = torch.Generator().manual_seed(0)
for s in range(0, 32, 4):  # the caches filled by a real prefill
    prompts = [torch.randint(0, 49000, (300,), generator=gen).tolist() for _ in range(4)]
    runner.forward([SeqChunk(s + i, 0, p, 1) for i, p in enumerate(prompts)])
ok = True
res = []
shapes = sys.argv[1:] or ["1x1", "1x8", "4x3", "8x1", "8x2", "16x1", "32x1", "32x2"]
for R, L in [tuple(map(int, a.split("x"))) for a in shapes]:
    chunks = [SeqChunk(s, 300, torch.randint(0, 49000, (L,), generator=gen).tolist(), L) for s in range(R)]
    outs = {}
    for v in VARIANTS:
        use(v)
        outs[v] = runner.forward(chunks, hidden_layers=(10, 20))
    same = all(torch.equal(outs["torch"].logits, o.logits)
               and all(torch.equal(outs["torch"].hidden_states[k], o.hidden_states[k]) for k in (10, 20))
               for o in outs.values())
    ok &= same
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(7):
        for v in VARIANTS:
            use(v)
            t0 = time.perf_counter()
            for _ in range(5):
                runner.forward(chunks)
            times[v].append((time.perf_counter() - t0) / 5 * 1e3)
    med = {v: statistics.median(t) for v, t in times.items()}
    res.append({"slots": R, "tokens_each": L, **{f"{v}_ms": round(m, 2) for v, m in med.items()},
                **{f"{v}_over_torch": round(m / med["torch"], 3) for v, m in med.items() if v != "torch"},
                "bit_identical": same})
    print(res[-1], file=sys.stderr, flush=True)
use("norms_silu")
print(json.dumps({"cpu": cpu_signature(), "sum_lanes": lanes(), "all_bit_identical": ok, "forward": res}))
