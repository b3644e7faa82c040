"""Session 51: the whole bf16 forward (`TargetRunner`, SmolLM2, 2 threads) with the native norms against PyTorch's
add and RMSNorm, in one process: logits and hidden states (layers 10 and 20) compared bit for bit, and each one's
time at R x L tokens (R slots of 300 cached tokens, L new tokens each), 7 turns of 5 forwards in turn, medians.
Prints one JSON line.
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
lanes = native.bf16_norm_lanes


def use(on):
    native.bf16_norm_lanes = lanes if on else (lambda: None)


g = torch.Generator().manual_seed(0)
# fill caches with a real prefill
pre = [
    SeqChunk(slot=s, start_pos=0, token_ids=torch.randint(0, 49000, (300,), generator=g).tolist(), num_logits=1)
    for s in range(32)
]
for s in range(0, 32, 4):
    runner.forward(pre[s : s + 4])
ok = True
res = []
for R, L in [
    tuple(map(int, a.split("x"))) for a in (sys.argv[1:] or ["1x1", "1x8", "4x3", "8x1", "8x2", "16x1", "32x1", "32x2"])
]:
    chunks = [
        SeqChunk(slot=s, start_pos=300, token_ids=torch.randint(0, 49000, (L,), generator=g).tolist(), num_logits=L)
        for s in range(R)
    ]
    outs = {}
    for on in (False, True):
        use(on)
        o = runner.forward(chunks, hidden_layers=(10, 20))
        outs[on] = o
    same = torch.equal(outs[0].logits, outs[1].logits) and all(
        torch.equal(outs[0].hidden_states[k], outs[1].hidden_states[k]) for k in (10, 20)
    )
    ok &= same
    times = {False: [], True: []}
    for _ in range(7):
        for on in (False, True):
            use(on)
            t0 = time.perf_counter()
            for _ in range(5):
                runner.forward(chunks)
            times[on].append((time.perf_counter() - t0) / 5 * 1e3)
    a, b = statistics.median(times[False]), statistics.median(times[True])
    res.append(
        {
            "slots": R,
            "tokens_each": L,
            "torch_ms": round(a, 2),
            "native_ms": round(b, 2),
            "native_over_torch": round(b / a, 3),
            "bit_identical": same,
        }
    )
    print(res[-1], file=sys.stderr, flush=True)
print(json.dumps({"cpu": cpu_signature(), "sum_lanes": lanes(), "all_bit_identical": ok, "forward": res}))
