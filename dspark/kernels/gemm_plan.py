"""Which matmul kernel runs the target's linear layers at a given row count, measured on this machine.

The fastest way to multiply T rows by a weight depends on the CPU, the dtype and T, and the gaps are
large (SmolLM2-135M, all layer GEMMs of one step, 2 threads, Xeon with AVX-512 + AMX):
- bf16, 8 rows: F.linear 21 ms, W @ xᵀ 14 ms; 1 row: torch.mv 12.7 ms, the others 19 ms;
- fp32, 2-8 rows: W @ xᵀ 48-50 ms, F.linear 20-45 ms, oneDNN with prepacked weights 28 ms at 8 rows;
and an AVX2-only CPU orders them differently again. In bf16 on a CPU with AMX the native tile kernel ("amx",
native_kernels.c) is a candidate too: on the same Xeon, all layer GEMMs of a step at 1 / 32 / 64 / 128 rows took
10.3 / 13.2 / 17.2 / 25.3 ms against the best row-invariant PyTorch kernel's 13.6 / 18.0 / 26.8 / 39.7 ms (oneDNN
stays row-invariant only up to ~32 rows, so a verify step past that fell back to W @ xᵀ). So nothing is assumed:
`measure_plan` times each candidate on the model's own weights at every row bucket (including the op that
consumes the output: a layer's residual add, the head's row max; W @ xᵀ returns a transposed view that slows its
consumer), and the result is cached per machine under ``~/.cache/dspark/gemm_plans/``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark.kernels import cache_once
from dspark.kernels.machine import cpu_signature

log = logging.getLogger(__name__)

# timed candidates; see `blocked` for the bf16 fallback
KERNELS = ("linear", "wx", "packed", "mv", "native", "amx", "dpbf16")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# the native kernel is kept if within this factor of the fastest: at those row counts the runner's fused
# path (native.py) also saves the ~2 ms of small PyTorch ops a step around the GEMMs, and a kernel used
# nowhere drops its weight copy (oneDNN's packed copy of SmolLM2 is 540 MB in fp32, per engine)
NATIVE_PREFERENCE = 1.15


@dataclass
class GemmPlan:
    """Kernel per row bucket, for the decoder layers' GEMMs and for the LM head."""

    layer_kernels: dict[int, str]
    head_kernels: dict[int, str]
    meta: dict

    @staticmethod
    def fixed(kernel: str) -> GemmPlan:
        return GemmPlan({b: kernel for b in ROW_BUCKETS}, {b: kernel for b in ROW_BUCKETS}, {"fixed": kernel})

    def kernel(self, rows: int, is_head: bool = False) -> str:
        table = self.head_kernels if is_head else self.layer_kernels
        bucket = next((b for b in ROW_BUCKETS if b >= rows), ROW_BUCKETS[-1])
        kernel = table[bucket]
        return "wx" if kernel == "mv" and rows > 1 else kernel

    @property
    def uses_packed(self) -> bool:
        return "packed" in self.base_kernels()

    def base_kernels(self) -> set[str]:
        """The kernels the plan runs, blocked ones by their inner kernel."""
        return {k.partition("/")[0] for k in (*self.layer_kernels.values(), *self.head_kernels.values())}

    def to_json(self) -> dict:
        return {"layer_kernels": self.layer_kernels, "head_kernels": self.head_kernels, "meta": self.meta}

    @staticmethod
    def from_json(d: dict) -> GemmPlan:
        return GemmPlan({int(k): v for k, v in d["layer_kernels"].items()},
                        {int(k): v for k, v in d["head_kernels"].items()}, d.get("meta", {}))


class PlannedLinear:
    """One weight (out, in), optionally also prepacked for oneDNN, applied with a chosen kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "gemm") -> None:
        self.name = name  # the native kernel's profiler label
        self.weight = weight.detach().contiguous()
        self.bias = bias.detach() if bias is not None else None
        self.packed: torch.Tensor | None = None
        self.native_packed: torch.Tensor | None = None
        self.amx_packed: torch.Tensor | None = None

    def native_weight(self) -> torch.Tensor:
        """The weight in the native kernels' layout (packed on first use)."""
        if self.native_packed is None:
            from dspark.kernels import native  # compiled on first use

            self.native_packed = native.pack(self.weight)
        return self.native_packed

    @functools.cached_property
    def takes_amx(self) -> bool:
        """Whether the AMX kernel takes this weight (elsewhere "amx" falls back to F.linear, as "packed" does)."""
        from dspark.kernels import native

        return native.supports_amx(self.weight)

    @functools.cached_property
    def takes_dpbf16(self) -> bool:
        """Whether the AVX512-BF16 kernel takes this weight (elsewhere "dpbf16" falls back to F.linear)."""
        from dspark.kernels import native

        return native.supports_dpbf16(self.weight)

    def amx_weight(self) -> torch.Tensor:
        """The weight in the AMX kernel's tile layout (packed on first use)."""
        if self.amx_packed is None:
            from dspark.kernels import native  # compiled on first use

            self.amx_packed = native.amx_pack(self.weight)
        return self.amx_packed

    def pack(self) -> bool:
        """Prepack for oneDNN (CPU only). False where this build or dtype cannot."""
        if self.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
            x = self.weight.new_zeros(2, self.weight.shape[1])
            torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        except (RuntimeError, NotImplementedError):
            self.packed = None
        return self.packed is not None

    def __call__(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """x (T, in) -> (T, out); "wx" returns a transposed view, which the following ops accept."""
        if kernel == "packed" and self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if "/" in kernel:  # "<kernel>/<rows>": see `blocked`
            inner, _, block = kernel.partition("/")
            return _in_blocks(x, int(block), lambda part: self(part, inner))
        if kernel == "native":
            from dspark.kernels import native

            out = native.linear(x, self.native_weight(), self.weight.shape[0], self.name)
        elif kernel == "amx" and self.takes_amx and x.dtype == torch.bfloat16:
            from dspark.kernels import native

            out = native.amx_linear(x, self.amx_weight(), self.weight.shape[0], self.name)
        elif kernel == "dpbf16" and self.takes_dpbf16 and x.dtype == torch.bfloat16:
            from dspark.kernels import native

            out = native.dpbf16_linear(x, self.amx_weight(), self.weight.shape[0], self.name)
        elif kernel == "mv" and x.shape[0] == 1:
            out = torch.mv(self.weight, x[0])[None]
        elif kernel == "wx":
            out = _wx(x, self.weight)
        else:
            return F.linear(x, self.weight, self.bias)
        return out + self.bias if self.bias is not None else out


def blocked(kernel: str, rows: int) -> str:
    """`kernel` applied to consecutive blocks of exactly `rows` rows, the last block zero-padded.

    The bf16 fallback where no kernel is row-invariant at a bucket (oneDNN's bf16 GEMMs change their
    reduction order past ~32 rows): a kernel that is row-invariant at `rows` rows stays so on every block,
    since each block has exactly the shape it was checked at. The weight is read once per block, where
    the old fallback (one GEMV per row) read it once per row: 256 prompt rows took 256 weight reads.
    """
    return f"{kernel}/{rows}"


def _in_blocks(x: torch.Tensor, block: int, apply: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    rows = x.shape[0]
    if rows == block:
        return apply(x)
    pad = -rows % block
    xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    out = torch.cat([apply(xp[i:i + block]) for i in range(0, xp.shape[0], block)])
    return out[:rows] if pad else out


def head_output(logits: torch.Tensor) -> torch.Tensor:
    """The LM head's output (N, V) made row-major, as its consumers need it: a row max or a sampler's pass over
    the transposed view W @ xᵀ leaves cost several times the GEMM (SmolLM2 bf16, 60 rows, 1 thread, AMX Xeon:
    row max 10 ms on the view; native transpose 1 ms, then 1.8 ms)."""
    if logits.is_contiguous():
        return logits
    from dspark.kernels import native  # compiled on first use

    return native.row_major(logits)


def wx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with the weight as the left operand (see `_wx`)."""
    out = _wx(x, weight)
    return out + bias if bias is not None else out


def _wx(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as (weight @ x.T).T, x row-major, padded to a multiple of 8 rows past 8 rows.

    MKL's kernel for the weight as the left operand was 2-4x faster than F.linear's for few rows on
    an AVX2 CPU, if x is row-major and its row count past 8 a multiple of 8 (at 9-15 rows it fell 2-3x
    behind its own time at 16). Whether it wins here is measured, not assumed.
    """
    rows = x.shape[0]
    pad = -rows % 8 if rows > 8 else 0
    x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x.contiguous()
    out = torch.mm(weight, x.t()).t()
    return out[:rows] if pad else out


def median_ms(fn: Callable[[], object], num_repeats: int, num_warmup: int = 1) -> float:
    """Median wall time of `fn` in ms over num_repeats calls, after num_warmup."""
    for _ in range(num_warmup):
        fn()
    samples = []
    for _ in range(num_repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _time_kernel(linears: list[PlannedLinear], rows: int, kernel: str, num_repeats: int,
                 is_head: bool = False) -> float:
    """All GEMMs of the set at `rows` rows, each followed by the op that consumes its output: a layer's by
    the residual add, the LM head's by a max over each row's logits (greedy acceptance, sampling). A
    transposed output (W @ xᵀ) costs its consumer little in an add and a lot in a row reduction: SmolLM2
    bf16 at 64 rows, 1 thread, Xeon with AMX: head 3.3 ms, head and row max 15.4 ms (prepacked oneDNN:
    3.7 and 6.6 ms)."""
    inputs = {lin.weight.shape[1]: lin.weight.new_ones(rows, lin.weight.shape[1]) * 0.01 for lin in linears}
    residual = {lin.weight.shape[0]: lin.weight.new_zeros(rows, lin.weight.shape[0]) for lin in linears}

    def run() -> None:
        for lin in linears:
            out = lin(inputs[lin.weight.shape[1]], kernel)
            _ = head_output(out).max(dim=-1).indices if is_head else residual[lin.weight.shape[0]] + out

    return median_ms(run, num_repeats)


def reference_kernel(linears: list[PlannedLinear]) -> str:
    """The one-row product every row bucket's kernel must reproduce bit for bit in bf16: F.linear ("linear"), or,
    where the AVX512-BF16 kernel takes the weights and the AMX one does not, that kernel on one row. Any one fixed
    reference keeps a token's values independent of how many rows its step carries, which is what verification
    needs. On such a CPU F.linear's one-row bf16 order (oneDNN's) differs from a tile kernel's in a few outputs
    per 10^5 (Zen 4 EPYC, SmolLM2's head: 10 of 393,216), so against it the kernel that is 2-3x faster at every
    row count (`dpbf16`, native_kernels.c) would be rejected everywhere. On an AMX CPU the AMX kernel reproduces
    F.linear, which stays the reference there."""
    if all(lin.takes_dpbf16 for lin in linears) and not all(lin.takes_amx for lin in linears):
        return "dpbf16"
    return "linear"


def _is_row_invariant(linears: list[PlannedLinear], rows: int, kernel: str) -> bool:
    """Does `kernel` at `rows` rows give every row bit for bit what the reference (`reference_kernel`: F.linear
    on most CPUs) gives that row alone?

    Needed in bf16, where each GEMM output is rounded to 8 bits of mantissa: a kernel whose reduction
    order changes with the row count (oneDNN's bf16 path past ~32 rows does) would make a token's
    logits depend on how many tokens its step carries, and greedy speculation would drift from
    target-only decoding. fp32 GEMMs are not row-invariant in MKL at all; their differences stay
    ~1e-7 relative, below what flips a greedy choice in practice, so fp32 is not restricted.
    A kernel that sums in another order than F.linear on one row gives a different bf16 value in a
    fraction of the outputs (thousands of a (64, 3072) product, a handful of a small one), so every row
    of two inputs is compared, on the model's own (large) shapes.
    """
    return all(torch.equal(lin(x, kernel), alone) for lin, x, alone in _row_references(linears, rows))


_REFERENCES: dict[tuple[int, int], list[tuple[PlannedLinear, torch.Tensor, torch.Tensor]]] = {}


def _row_references(linears: list[PlannedLinear], rows: int) -> list[tuple[PlannedLinear, torch.Tensor, torch.Tensor]]:
    """(linear, x, every row of x alone) for every distinct shape of a decoder layer and the last linear,
    two inputs each: computed once per set and row count (each check of a candidate compares with them)."""
    key = (id(linears[0]), rows)
    refs = _REFERENCES.get(key)
    if refs is None or refs[0][0] is not linears[0]:
        gen = torch.Generator().manual_seed(rows)
        refs = []
        reference = reference_kernel(linears)
        for lin in linears[:4] + linears[-1:]:
            for _ in range(2):
                x = torch.randn(rows, lin.weight.shape[1], generator=gen).to(lin.weight.dtype)
                refs.append((lin, x, torch.cat([lin(x[i:i + 1], reference) for i in range(rows)])))
        _REFERENCES.clear()  # one set's at a time: measure_plan asks for a set's row counts in turn
        _REFERENCES[key] = refs
    return refs


def available_kernels(can_pack: bool, weight: torch.Tensor) -> list[str]:
    """The candidates for weights like `weight` (native: fp32 on a CPU with a C compiler; amx: bf16 on a CPU with
    AMX-BF16; dpbf16: bf16 on a CPU with AVX512-BF16)."""
    from dspark.kernels import native

    # dpbf16 only where AMX is not: beside the AMX kernel (F.linear's bits) it could match F.linear on the plan's
    # few sample rows by chance at one bucket and mix two reduction orders in one plan
    return [k for k in KERNELS if (k != "packed" or can_pack) and (k != "native" or native.supports(weight))
            and (k != "amx" or native.supports_amx(weight))
            and (k != "dpbf16" or (native.supports_dpbf16(weight) and not native.supports_amx(weight)))]


def _drop_unused_copies(plan: GemmPlan, linears: list[PlannedLinear]) -> None:
    """A kernel's weight copy (oneDNN's, the native layout) is kept only where the plan uses that kernel."""
    used = plan.base_kernels()
    for lin in linears:
        if "packed" not in used:
            lin.packed = None
        if "native" not in used:
            lin.native_packed = None
        if not {"amx", "dpbf16"} & used:  # they share the packed layout
            lin.amx_packed = None


def measure_plan(layers: list[PlannedLinear], head: PlannedLinear, num_repeats: int = 3,
                 row_invariant: bool = True) -> GemmPlan:
    """Time every candidate kernel per row bucket; keep the fastest for the layers and for the head
    (with `row_invariant`, in bf16 / fp16 the fastest of those that are row-invariant, see
    `_is_row_invariant`: what verification needs; bulk generation, which is compared with nothing,
    may take any)."""
    can_pack = all(lin.pack() for lin in layers + [head])
    candidates = available_kernels(can_pack, head.weight)
    is_low_precision = row_invariant and head.weight.dtype in (torch.bfloat16, torch.float16)
    timings: dict[str, dict[int, dict[str, float]]] = {"layers": {}, "head": {}}
    choice: dict[str, dict[int, str]] = {"layers": {}, "head": {}}
    rejected: dict[str, dict[int, list[str]]] = {"layers": {}, "head": {}}
    fallback: list[str] = []
    with torch.inference_mode():
        for group, linears in (("layers", layers), ("head", [head])):
            takes_amx = "amx" in candidates and all(lin.takes_amx for lin in linears)
            takes_dpbf16 = "dpbf16" in candidates and all(lin.takes_dpbf16 for lin in linears)
            reference = reference_kernel(linears)
            for rows in ROW_BUCKETS:
                kernels = [k for k in candidates if (k != "mv" or rows == 1) and (k != "amx" or takes_amx)
                           and (k != "dpbf16" or takes_dpbf16)]
                if is_low_precision and reference != "linear":
                    # a native tile kernel as the reference: invariant by construction, and the only candidate (another
                    # kernel could match it on the sample rows by chance and bring its own order to some rows)
                    rejected[group][rows] = [k for k in kernels if k != reference]
                    kernels = [reference]
                elif is_low_precision:
                    variant = [k for k in kernels if not _is_row_invariant(linears, rows, k)]
                    rejected[group][rows] = variant
                    kernels = [k for k in kernels if k not in variant]
                    if not kernels:  # none is: an invariant kernel of a smaller bucket, block by block
                        fallback.append(f"{group}@{rows}")
                        kernels = [blocked(choice[group][b], b) for b in ROW_BUCKETS if b < rows
                                   and "/" not in choice[group][b]
                                   and _is_row_invariant(linears, rows, blocked(choice[group][b], b))]
                        kernels = kernels or [blocked(reference, 1)]  # one row at a time: the reference
                times = {k: _time_kernel(linears, rows, k, num_repeats, is_head=group == "head") for k in kernels}
                timings[group][rows] = {k: round(v, 3) for k, v in times.items()}
                best = min(times, key=times.__getitem__)
                if times.get("native", float("inf")) <= NATIVE_PREFERENCE * times[best]:
                    best = "native"  # see NATIVE_PREFERENCE
                choice[group][rows] = best
    _REFERENCES.clear()  # they hold the weights: not past the measurement
    plan = GemmPlan(choice["layers"], choice["head"], {"timings_ms": timings, "row_variant": rejected,
                                                       "row_invariant_fallback": fallback})
    _drop_unused_copies(plan, layers + [head])
    return plan


def plan_key(layers: list[PlannedLinear], head: PlannedLinear, row_invariant: bool) -> str:
    shapes = sorted({tuple(lin.weight.shape) for lin in layers}) + [tuple(head.weight.shape)]
    ident = {"cpu": cpu_signature(), "torch": torch.__version__, "threads": torch.get_num_threads(),
             "dtype": str(head.weight.dtype), "shapes": shapes, "num_layers": len(layers),
             "row_invariant": row_invariant, "kernels": available_kernels(True, head.weight),
             "fallback": "blocked",  # plans of the one-row-at-a-time fallback are measured again
             "head_consumer": "row-major, row max",  # and those that timed the head without its consumer
             "reference": reference_kernel(layers + [head])}  # what row invariance is checked against
    if {"native", "amx", "dpbf16"} & set(ident["kernels"]):
        from dspark.kernels import native

        ident["native_build"] = native.build_id()  # a rebuilt kernel is measured again
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


_MEMO: dict[str, GemmPlan] = {}


def plan_for(layers: list[PlannedLinear], head: PlannedLinear, cache_root: Path | None,
             row_invariant: bool = True) -> GemmPlan:
    """The measured plan for these weights on this machine: from memory, from disk, or measured now."""
    if head.weight.device.type != "cpu":
        return GemmPlan.fixed("linear")
    key = plan_key(layers, head, row_invariant)
    path = cache_root / "gemm_plans" / f"{key}.json" if cache_root is not None else None
    plan = _MEMO.get(key)
    is_measured = False
    if plan is None and path is not None:
        plan = _read_plan(path)
        if plan is None:  # measured once per machine: the other processes wait for it, then read it
            with cache_once.locked(f"gemm-plan-{key}", cache_root):
                plan = _read_plan(path)
                if plan is None:
                    plan, is_measured = _measure(layers, head, row_invariant), True
                    cache_once.publish_json(path, plan.to_json())
    elif plan is None:
        plan, is_measured = _measure(layers, head, row_invariant), True
    if not is_measured and plan.uses_packed:  # measuring packs; a plan read back packs the weights it uses
        for lin in layers + [head]:
            lin.pack()
    _MEMO[key] = plan
    return plan


def _read_plan(path: Path) -> GemmPlan | None:
    d = cache_once.read_json(path)
    try:
        return GemmPlan.from_json(d) if d is not None else None
    except (KeyError, TypeError, ValueError):  # a damaged file: measured again
        return None


def _measure(layers: list[PlannedLinear], head: PlannedLinear, row_invariant: bool) -> GemmPlan:
    t0 = time.perf_counter()
    plan = measure_plan(layers, head, row_invariant=row_invariant)
    plan.meta.update({"cpu": cpu_signature(), "dtype": str(head.weight.dtype), "row_invariant": row_invariant,
                      "measure_s": round(time.perf_counter() - t0, 2)})
    log.info("GEMM plan measured in %.1f s: %s", plan.meta["measure_s"], plan.layer_kernels)
    return plan
