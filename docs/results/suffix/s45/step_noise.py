"""Forward steps at 32 x n tokens, bf16, 2 threads, this process at nice 10 (as a pool replica), with and without a
burst-noise process (noise.py) at nice 0 beside it; median / p90 step ms. Arguments: noise settings "B,S,T" (busy B
ms, asleep S ms, in T threads) or "none". Session 45: `python step_noise.py none 0.5,4.5,1 1,9,1 0.3,2.7,2 none`."""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

NOISE = Path(__file__).with_name("noise.py")


def main() -> None:
    torch.set_num_threads(2)
    os.nice(10)
    target = load_target("smollm2-135m-instruct", "cpu", "bf16")
    batch, ctx_len = 32, 300
    probe = TargetRunner(target.model, 1, 8, row_invariant=True)
    runner = TargetRunner(target.model, batch, ctx_len + 64, gemm_plan=probe.gemm_plan, row_invariant=True)
    slots = [runner.cache.allocate() for _ in range(batch)]
    ctx = [(100 + i) % runner.vocab_size for i in range(ctx_len)]

    def steps(n: int, k: int = 25) -> tuple[float, float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            runner.forward([SeqChunk(s, ctx_len, [5] * n, n) for s in slots])
            out.append((time.perf_counter() - t0) * 1e3)
        out.sort()
        return statistics.median(out), out[int(0.9 * len(out))]

    with torch.inference_mode():
        for lo in range(0, batch, 8):
            runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots[lo:lo + 8]])
        steps(1, 3)
        for noise in sys.argv[1:]:
            proc = None
            if noise != "none":
                busy, sleep, threads = noise.split(",")
                proc = subprocess.Popen([sys.executable, str(NOISE), busy, sleep, threads, "600"],
                                        preexec_fn=lambda: os.nice(-10))
                time.sleep(1)
            res = {n: steps(n) for n in (1, 2)}
            if proc is not None:
                proc.kill()
                proc.wait()
            print(f"noise {noise:12s}: " + "  ".join(f"32x{n}: med {m:.1f} p90 {q:.1f}" for n, (m, q) in res.items()),
                  flush=True)


if __name__ == "__main__":
    main()
