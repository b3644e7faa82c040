"""Session 46: the bf16 forward with PyTorch's RMSNorm, residual add and SiLU·up (A) against the native bf16 passes
(B), interleaved in one process (2 threads, 256 cached positions a sequence), median of 15 steps, 3 rounds; then how
many elements of each op's output differ from PyTorch's on a real prefill (8 mt-bench prompts).
Needs the native norms of commit fa87e80 (reverted in the same session): `git checkout fa87e80`, then
python docs/results/suffix/s46/native_norms/norm_ab.py"""

import json

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from dspark.kernels.gemm_plan import median_ms
from dspark.models.target import layer as L
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target, resolve_target_path
from dspark.models.target.runner import TargetRunner

NATIVE = L._native_rows


def torch_only(x: torch.Tensor) -> bool:
    return NATIVE(x) and x.dtype == torch.float32


def timings(target) -> None:
    ctx_len = 256
    probe = TargetRunner(target.model, 1, 8, row_invariant=True)
    runner = TargetRunner(target.model, 32, ctx_len + 64, gemm_plan=probe.gemm_plan, row_invariant=True)
    slots = [runner.cache.allocate() for _ in range(32)]
    ctx = [(100 + i) % runner.vocab_size for i in range(ctx_len)]
    with torch.inference_mode():
        for lo in range(0, 32, 8):
            runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots[lo : lo + 8]])
        res: dict[tuple[str, int, int], list[float]] = {}
        for _ in range(3):
            for arm, fn in (("pytorch", torch_only), ("native", NATIVE)):
                L._native_rows = fn
                for b, n in ((1, 1), (32, 1), (32, 2), (32, 3)):
                    chunks = [SeqChunk(s, ctx_len, [5] * n, n) for s in slots[:b]]
                    res.setdefault((arm, b, n), []).append(median_ms(lambda c=chunks: runner.forward(c), 15))
        L._native_rows = NATIVE
    for (arm, b, n), v in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        print(f"{arm:7s} {b:2d} x {n}: {sorted(v)[1]:6.2f} ms  (rounds {[round(x, 2) for x in v]})")


def differing_elements(target) -> None:
    runner = TargetRunner(target.model, 8, 400, row_invariant=True)
    slots = [runner.cache.allocate() for _ in range(8)]
    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
    with open("../shared/data/eval/mt-bench.jsonl") as f:
        rows = [json.loads(line) for line in f][:8]
    ids = [tok(str(r["turns"][0]))["input_ids"][:200] for r in rows]
    counts: dict[str, list[int]] = {}
    o_rms, o_add, o_silu = L.native.rms_norm, L.native.add_rms_norm, L.native.silu_mul

    def note(op: str, got: torch.Tensor, want: torch.Tensor) -> None:
        c = counts.setdefault(op, [0, 0])
        c[0] += int((got.view(torch.int16) != want.view(torch.int16)).sum())
        c[1] += got.numel()

    def rms(x, w, eps):
        out = o_rms(x, w, eps)
        note("rms_norm", out, F.rms_norm(x, (x.shape[-1],), w, eps))
        return out

    def add_rms(x, r, w, eps):
        total, out = o_add(x, r, w, eps)
        note("residual sum", total, x + r)
        note("rms_norm of the sum", out, F.rms_norm(x + r, (x.shape[-1],), w, eps))
        return total, out

    def silu(g):
        out = o_silu(g)
        gate, up = g.chunk(2, dim=-1)
        note("silu_mul", out, F.silu(gate) * up)
        return out

    L.native.rms_norm, L.native.add_rms_norm, L.native.silu_mul = rms, add_rms, silu
    try:
        with torch.inference_mode():
            runner.forward([SeqChunk(s, 0, t, 1) for s, t in zip(slots, ids)])
    finally:
        L.native.rms_norm, L.native.add_rms_norm, L.native.silu_mul = o_rms, o_add, o_silu
    for op, (n, total) in counts.items():
        print(f"{op}: {n} of {total} elements differ from PyTorch's ({1e6 * n / total:.1f} per million)")


def main() -> None:
    torch.set_num_threads(2)
    target = load_target("smollm2-135m-instruct", "cpu", "bf16")
    timings(target)
    differing_elements(target)


if __name__ == "__main__":
    main()
