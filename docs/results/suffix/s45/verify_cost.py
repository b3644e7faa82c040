"""Forward cost at 32 sequences x n tokens (n = 1..8, logits at every token), bf16, 2 threads, and a profile of the
top ops at n = 1 and 2. Session 45: `python verify_cost.py 256` before and after the AMX GEMM (inprocess.txt)."""

import sys

import torch

from dspark.kernels.gemm_plan import median_ms
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner


def main() -> None:
    torch.set_num_threads(2)
    target = load_target("smollm2-135m-instruct", "cpu", "bf16")
    batch, ctx_len = 32, int(sys.argv[1]) if len(sys.argv) > 1 else 256
    probe = TargetRunner(target.model, 1, 8, row_invariant=True)
    runner = TargetRunner(target.model, batch, ctx_len + 64, gemm_plan=probe.gemm_plan, row_invariant=True)
    slots = [runner.cache.allocate() for _ in range(batch)]
    ctx = [(100 + i) % runner.vocab_size for i in range(ctx_len)]

    def step(n: int) -> None:
        runner.forward([SeqChunk(s, ctx_len, [5] * n, n) for s in slots])

    with torch.inference_mode():
        for lo in range(0, batch, 8):
            runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots[lo:lo + 8]])
        for n in (1, 2, 3, 4, 8):
            ms = median_ms(lambda n=n: step(n), 9)
            print(f"32 x {n}: {ms:.1f} ms  ({ms / (32 * n):.3f} ms/token)", flush=True)
        for n in (1, 2):
            with torch.profiler.profile() as prof:
                for _ in range(3):
                    step(n)
            print(f"--- profile 32 x {n} (ms per step, self time)")
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]:
                print(f"  {e.self_cpu_time_total / 3e3:7.2f}  {e.count // 3:5d}  {e.key}")


if __name__ == "__main__":
    main()
