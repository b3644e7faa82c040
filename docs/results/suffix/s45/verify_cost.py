"""Forward cost at 32 sequences x n tokens (n = 1..4, logits at every token), bf16, 2 threads; profile top ops."""
import sys, torch
from collections import defaultdict
torch.set_num_threads(2)
from dspark.kernels.gemm_plan import median_ms
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner
target = load_target("smollm2-135m-instruct", "cpu", "bf16")
B, ctx_len = 32, int(sys.argv[1]) if len(sys.argv) > 1 else 256
probe = TargetRunner(target.model, 1, 8, row_invariant=True)
r = TargetRunner(target.model, B, ctx_len + 64, gemm_plan=probe.gemm_plan, row_invariant=True)
slots = [r.cache.allocate() for _ in range(B)]
ctx = [(100 + i) % r.vocab_size for i in range(ctx_len)]
with torch.inference_mode():
    for lo in range(0, B, 8):
        r.forward([SeqChunk(s, 0, ctx, 1) for s in slots[lo:lo + 8]])
    for n in (1, 2, 3, 4, 8):
        step = lambda: r.forward([SeqChunk(s, ctx_len, [5] * n, n) for s in slots])
        ms = median_ms(step, 9)
        print(f"32 x {n}: {ms:.1f} ms  ({ms / (32 * n):.3f} ms/token)", flush=True)
    for n in (1, 2):
        with torch.profiler.profile() as prof:
            for _ in range(3):
                r.forward([SeqChunk(s, ctx_len, [5] * n, n) for s in slots])
        print(f"--- profile 32 x {n} (ms per step, self time)")
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]
        for e in rows:
            print(f"  {e.self_cpu_time_total / 3e3:7.2f}  {e.count // 3:5d}  {e.key}")
