"""`dspark bench roofline`: this machine's limits at the target's own shapes, and how close decode gets.

Measured, per dtype (by default fp32, and bf16 only where the CPU has bf16 units; a progress bar with an
estimate of the time left, the wall time in the JSON):
- the GEMM roofline: FLOP/s of ALL the model's GEMMs of one step (its real weights, every layer, and
  the LM head) at 1 ... 512 rows, with the fastest kernel at each row count (`gemm_plan` candidates);
- memory bandwidth: a large copy, a weight-streaming read (summing every weight once), and the read rate
  of the fastest one-row GEMM (which streams every weight once); the floor uses the best of the three;
- per-op dispatch: the wall time of a tiny op, which bounds what 30 layers of small ops cost;
- target-only decode at batch 1, 8, 32, 128, 256: achieved model FLOP/s (2 × parameters per token)
  as a fraction of the roofline at that row count, the batch-1 step against its memory floor (weight
  bytes ÷ bandwidth), and where the step's time goes (profiler self time by component; what the ops
  do not account for is Python and dispatch).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch
from tqdm import tqdm

from dspark.kernels.gemm_plan import GemmPlan, PlannedLinear, available_kernels, median_ms
from dspark.kernels.machine import cpu_signature, has_bf16_units
from dspark.models.target.dtype_choice import candidate_dtypes
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner

log = logging.getLogger(__name__)

GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE_BATCHES = (1, 8, 32, 128, 256)

# profiler op name -> component of a decode step
_COMPONENTS = {
    "gemm": ("aten::mm", "aten::mv", "aten::addmv_", "aten::addmv", "aten::addmm", "mkldnn::_linear_pointwise",
             "aten::matmul", "native::gemm"),
    "fused_layers": ("native::decoder_stack",),  # the few-token path: every layer in one native call
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                  "aten::_efficient_attention_forward", "aten::_flash_attention_forward",
                  "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
                  "native::attention"),
    "norms": ("aten::_fused_rms_norm", "aten::rms_norm", "aten::pow", "aten::mean", "aten::rsqrt"),
    "kv_cache": ("aten::index_copy_",),
    "lm_head": ("native::lm_head",),
}


def _linears(runner: TargetRunner) -> tuple[list[PlannedLinear], PlannedLinear]:
    return [lin for ly in runner.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)], runner.lm_head


def flops_per_token(runner: TargetRunner) -> float:
    layers, head = _linears(runner)
    return float(sum(2 * lin.weight.numel() for lin in layers + [head]))


def gemm_roofline(runner: TargetRunner, rows_grid: tuple[int, ...] = GEMM_ROWS, num_repeats: int = 5,
                  bar: tqdm | None = None) -> dict:
    """GFLOP/s of one step's GEMMs (layers + LM head) at each row count, best kernel and all kernels."""
    layers, head = _linears(runner)
    can_pack = all(lin.pack() for lin in layers + [head])
    out: dict[int, dict] = {}
    flops_tok = flops_per_token(runner)
    with torch.inference_mode():
        for rows in rows_grid:
            if bar is not None:
                bar.set_postfix_str(f"GEMM roofline, {rows} rows")
            xs = {lin.weight.shape[1]: lin.weight.new_ones(rows, lin.weight.shape[1]) * 0.01
                  for lin in layers + [head]}
            per_kernel = {}
            for kernel in available_kernels(can_pack, head.weight):
                if kernel == "mv" and rows != 1:
                    continue
                ms = median_ms(lambda k=kernel, xs=xs: [lin(xs[lin.weight.shape[1]], k) for lin in layers + [head]],
                                num_repeats)
                per_kernel[kernel] = round(flops_tok * rows / ms / 1e6, 1)  # GFLOP/s
            best = max(per_kernel, key=per_kernel.__getitem__)
            out[rows] = {"gflop_s": per_kernel[best], "kernel": best, "by_kernel": per_kernel}
            if bar is not None:
                bar.update(_gemm_work(flops_tok, rows, len(per_kernel), num_repeats))
    return out


# ---- the progress bar's work units (GFLOP of the model's GEMMs; attention and norms ride along) ------------
def _gemm_work(flops_tok: float, rows: int, num_kernels: int, num_repeats: int = 5) -> float:
    return flops_tok * rows * num_kernels * (num_repeats + 1) / 1e9


def _decode_work(flops_tok: float, batch: int, context_len: int, num_steps: int = 8) -> float:
    steps = (num_steps + 1) + 3 + 3 + 1  # timed + warmup, profiled, wall, the one the profiler warms
    return flops_tok * batch * (context_len + steps) / 1e9


def _planned_work(flops_tok: float, dtypes: list[str], batches: tuple[int, ...], context_len: int,
                  num_kernels: int) -> float:
    per_dtype = sum(_gemm_work(flops_tok, r, num_kernels) for r in GEMM_ROWS) \
        + sum(_decode_work(flops_tok, b, context_len) for b in batches)
    return per_dtype * len(dtypes)


def _decode_estimate_s(flops_tok: float, batches: tuple[int, ...], context_len: int, roof: dict) -> float:
    """Seconds the decode part will take, at the GEMM roofline measured just before (a lower bound)."""
    def rate(rows: int) -> float:
        return roof[min(roof, key=lambda r: abs(r - rows))]["gflop_s"]
    return sum(flops_tok * b * context_len / 1e9 / rate(min(b * context_len, 512))
               + _decode_work(flops_tok, b, 0) / rate(b) for b in batches)


def memory_bandwidth(runner: TargetRunner, copy_mb: int = 1024, num_repeats: int = 5) -> dict:
    """GB/s of a large copy (read + write) and of one read of every weight."""
    src = torch.ones(copy_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), num_repeats)
    layers, head = _linears(runner)
    weights = [lin.weight for lin in layers + [head]]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    read_ms = median_ms(lambda: [w.sum() for w in weights], num_repeats)
    return {"copy_gb_s": round(2 * src.numel() * 4 / copy_ms / 1e6, 1),
            "weight_read_gb_s": round(weight_bytes / read_ms / 1e6, 1), "weight_bytes": weight_bytes}


def dispatch_cost_us(num_ops: int = 20_000) -> float:
    x = torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(num_ops):
        x.add_(1.0)
    return round((time.perf_counter() - t0) * 1e6 / num_ops, 2)


def decode_breakdown(model: torch.nn.Module, plan: GemmPlan, batch: int, context_len: int = 128,
                     num_steps: int = 8, row_invariant: bool = False) -> dict:
    """Median decode step at `batch` sequences over a context, and its time by component."""
    r = TargetRunner(model, batch, context_len + 64, gemm_plan=plan, row_invariant=row_invariant)
    slots = [r.cache.allocate() for _ in range(batch)]
    ctx = [(100 + i) % r.vocab_size for i in range(context_len)]
    for lo in range(0, batch, 32):  # prefill in pieces: attention's padded view stays small
        r.forward([SeqChunk(s, 0, ctx, 1) for s in slots[lo:lo + 32]])
    pos = [context_len]

    def step() -> None:
        r.forward([SeqChunk(s, pos[0], [5], 1) for s in slots])
        pos[0] += 1

    step_ms = median_ms(step, num_steps)
    vocab = r.lm_head.weight.shape[0]
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(3):
            step()
    totals: dict[str, float] = defaultdict(float)
    op_total = 0.0
    for evt in prof.key_averages(group_by_input_shape=True):
        us = evt.self_cpu_time_total / 3
        op_total += us
        comp = next((c for c, names in _COMPONENTS.items() if evt.key in names), "elementwise_and_other")
        if comp == "gemm" and any(vocab in s for s in (evt.input_shapes or [])):  # a (V, D) operand
            comp = "lm_head"
        totals[comp] += us
    prof_step_ms = op_total / 1e3
    components = {k: round(v / 1e3, 2) for k, v in sorted(totals.items())}
    # the profiler's own overhead inflates op times a little: report shares of the profiled step
    wall_ms = median_ms(step, 3, num_warmup=0)
    components["python_and_dispatch"] = round(max(0.0, wall_ms - prof_step_ms), 2)
    return {"step_ms": round(step_ms, 2), "tok_s": round(batch / step_ms * 1e3, 1), "components_ms": components}


def run_roofline(target_name: str, dtypes: list[str] | None = None, device: str = "cpu",
                 batches: tuple[int, ...] = DECODE_BATCHES, context_len: int = 128,
                 row_invariant: bool = False, show_progress: bool = True) -> dict:
    """`dtypes`: None or empty = this machine's candidates (fp32, and bf16 only where the CPU has bf16
    units or on a GPU). `row_invariant`: decode with the verify engine's kernels (bit-stable rows in bf16)
    instead of the generation path's (any kernel). A progress bar counts the GEMM work done (GFLOP)."""
    t_start = time.perf_counter()
    dtypes = dtypes or candidate_dtypes(device)
    slow = [d for d in dtypes if d in ("bf16", "fp16") and not str(device).startswith("cuda") and not has_bf16_units()]
    if slow:
        log.warning("%s asked for, but this CPU has no bf16 units (AVX-512 BF16 / AMX): emulated and slow; the "
                    "default measures only %s here", ",".join(slow), ",".join(candidate_dtypes(device)))
    res: dict = {"cpu": cpu_signature(), "torch": torch.__version__, "num_threads": torch.get_num_threads(),
                 "context_len": context_len, "row_invariant": row_invariant, "dtypes": dtypes, "by_dtype": {}}
    bar: tqdm | None = None
    for dtype in dtypes:
        target = load_target(target_name, device, dtype)
        runner = TargetRunner(target.model, 1, 8, row_invariant=row_invariant)
        flops_tok = flops_per_token(runner)
        if bar is None:
            layers, head = _linears(runner)
            num_kernels = len(available_kernels(all(lin.pack() for lin in layers + [head]), head.weight))
            bar = tqdm(total=round(_planned_work(flops_tok, dtypes, batches, context_len, num_kernels)),
                       desc="bench roofline", unit="GFLOP", disable=not show_progress)
        bar.set_description(f"roofline {dtype}")
        roof = gemm_roofline(runner, bar=bar)
        bw = memory_bandwidth(runner)
        est = _decode_estimate_s(flops_tok, batches, context_len, roof)
        log.info("%s: GEMM roofline measured; decode at batches %s will take about %.0f s (at least)",
                 dtype, ",".join(map(str, batches)), est)
        decode = {}
        for b in batches:
            bar.set_postfix_str(f"decode, batch {b} (~{est / 60:.1f} min of decode in all)")
            d = decode_breakdown(target.model, runner.gemm_plan, b, context_len, row_invariant=row_invariant)
            bar.update(_decode_work(flops_tok, b, context_len))
            achieved = flops_tok * b / d["step_ms"] / 1e6
            rows = min(GEMM_ROWS, key=lambda r, b=b: abs(r - b))
            d.update({"achieved_gflop_s": round(achieved, 1), "roofline_gflop_s": roof[rows]["gflop_s"],
                      "fraction_of_roofline": round(achieved / roof[rows]["gflop_s"], 3)})
            decode[b] = d
        # the best read the machine demonstrably does: a copy, a sum of every weight, or the one-row GEMM
        # itself (the native kernel streams weights faster than `sum` on some CPUs)
        one_row_ms = flops_tok / roof[1]["gflop_s"] / 1e6
        bw["gemm_one_row_read_gb_s"] = round(bw["weight_bytes"] / one_row_ms / 1e6, 1)
        floor_ms = bw["weight_bytes"] / max(bw["copy_gb_s"], bw["weight_read_gb_s"],
                                            bw["gemm_one_row_read_gb_s"]) / 1e6
        res["by_dtype"][dtype] = {
            "gemm_roofline": roof, "memory": bw, "dispatch_us_per_op": dispatch_cost_us(),
            "flops_per_token": flops_tok, "memory_floor_ms": round(floor_ms, 2), "decode": decode,
            "batch1_over_memory_floor": round(decode[batches[0]]["step_ms"] / floor_ms, 2) if 1 in batches else None}
        del runner, target
    if bar is not None:
        bar.close()
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    best = min(res["by_dtype"], key=lambda dt: res["by_dtype"][dt]["decode"][batches[-1]]["step_ms"])
    res["dtype"] = best  # the faster dtype at the largest batch; both are reported
    res["decode"] = res["by_dtype"][best]["decode"]
    res["batch1_over_memory_floor"] = res["by_dtype"][best]["batch1_over_memory_floor"]
    return res
