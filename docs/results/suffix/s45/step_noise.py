"""Forward steps at 32 x n tokens, bf16, 2 threads, this process at nice 10 (as a pool replica), with and without
a burst-noise process at nice 0 beside it. Prints median / p90 step ms."""
import os, subprocess, sys, statistics as st, time, torch
torch.set_num_threads(2)
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner
os.nice(10)
target = load_target("smollm2-135m-instruct", "cpu", "bf16")
B, ctx_len = 32, 300
probe = TargetRunner(target.model, 1, 8, row_invariant=True)
r = TargetRunner(target.model, B, ctx_len + 64, gemm_plan=probe.gemm_plan, row_invariant=True)
slots = [r.cache.allocate() for _ in range(B)]
ctx = [(100 + i) % r.vocab_size for i in range(ctx_len)]
def steps(n, k=25):
    out = []
    for _ in range(k):
        t0 = time.perf_counter(); r.forward([SeqChunk(s, ctx_len, [5] * n, n) for s in slots]); out.append((time.perf_counter() - t0) * 1e3)
    out.sort(); return st.median(out), out[int(0.9 * len(out))]
with torch.inference_mode():
    for lo in range(0, B, 8):
        r.forward([SeqChunk(s, 0, ctx, 1) for s in slots[lo:lo + 8]])
    steps(1, 3)
    for noise in sys.argv[1:]:
        p = None
        if noise != "none":
            b, s, t = noise.split(",")
            p = subprocess.Popen([sys.executable, "/tmp/s45/noise.py", b, s, t, "600"], preexec_fn=lambda: os.nice(-10))
            time.sleep(1)
        res = {n: steps(n) for n in (1, 2)}
        if p: p.kill(); p.wait()
        print(f"noise {noise:12s}: " + "  ".join(f"32x{n}: med {m:.1f} p90 {q:.1f}" for n, (m, q) in res.items()), flush=True)
