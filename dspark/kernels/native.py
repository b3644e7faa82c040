"""Native CPU kernels (`native_kernels.c`), compiled on first use for this machine and cached.

Why: at 1-16 rows a step is memory-bound, and the best PyTorch kernel at one fp32 row (MKL's, via
`torch.mv` / `F.linear`) streamed SmolLM2-135M's weights at 15.6 GB/s on a 2-core AMD EPYC where a plain
OpenMP dot-product loop streams the same 538 MB at 58 GB/s (34.4 against 9.2 ms a step). The kernels
are one more candidate of the measured GEMM plan (`gemm_plan.py`): used only where they time fastest.

Built with the system C compiler (`cc`, `-O3 -march=native -fopenmp`), once per source, CPU and compiler,
into ``~/.cache/dspark/native/`` (by one process, under a lock: `cache_once.py`); no `-ffast-math` (it would
link code that sets flush-to-zero for the whole process). OpenMP resolves to the libgomp that torch has
already loaded, so both share one pool.
Without a compiler, or with DSPARK_NATIVE=0 in the environment, the kernels are simply not candidates.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dspark.kernels import cache_once, huge_pages
from dspark.kernels.cache_once import cache_dir
from dspark.kernels.machine import ISA_ENV, cpu_signature

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.c")
AMX_ENV = "DSPARK_AMX"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-funroll-loops", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c11")


def cflags() -> tuple[str, ...]:
    """CFLAGS for this machine, or for an AVX2-only one where DSPARK_CPU_ISA=avx2 asks to emulate it."""
    if os.environ.get(ISA_ENV, "").lower() == "avx2":
        return tuple("-march=x86-64-v3" if f == "-march=native" else f for f in CFLAGS) + ("-mtune=native",)
    return CFLAGS


def traced(name: str) -> contextlib.AbstractContextManager:
    """A profiler range around a native call (which PyTorch's profiler cannot see), only while profiling."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where no compiler is available or the build fails (logged)."""
    import torch  # noqa: F401  (torch's libgomp is loaded first: the kernels share its thread pool)

    if os.environ.get("DSPARK_NATIVE", "1") == "0":  # the switch to PyTorch kernels only
        return None
    cc = _compiler()
    if cc is None or not SOURCE.exists():
        log.warning("native kernels unavailable: no C compiler (set CC) or source missing")
        return None
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native kernels unavailable: %s", e)
        return None
    ident = repr((source, cpu_signature(), version, cflags())).encode()
    out = cache_dir() / "native" / f"kernels-{hashlib.sha256(ident).hexdigest()[:16]}.so"  # see build_id
    if not out.exists():
        with cache_once.locked("native"):  # built once per machine: the other processes wait, then load it
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                cache_once.remove_stale(out)
                tmp = cache_once.tmp_path(out)
                res = subprocess.run([cc, *cflags(), str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True,
                                     text=True)
                if res.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    log.warning("native kernels failed to build:\n%s", res.stderr[-2000:])
                    return None
                tmp.replace(out)
    lib = ctypes.CDLL(str(out))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gemm_blocked_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
    lib.gemm_blocked_f32.restype = None
    lib.native_tile_outputs.argtypes = []
    lib.native_tile_outputs.restype = i64
    lib.decoder_stack_f32.argtypes = ([i64, ptr, ptr, i64] + [ptr] * 8 + [i64] * 5 + [ctypes.c_float] * 2
                                      + [i64, ptr, ptr, i64])
    lib.decoder_stack_f32.restype = None
    lib.attention_f32.argtypes = [i64, ptr, i64] + [ptr] * 6 + [i64] * 3 + [ctypes.c_float, i64, i64]
    lib.attention_f32.restype = None
    lib.attention_bf16.argtypes = lib.attention_f32.argtypes
    lib.attention_bf16.restype = None
    lib.nucleus_candidates.argtypes = [i64, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64]
    lib.nucleus_candidates.restype = None
    lib.rotary_cache_write.argtypes = [i64] + [ptr] * 6 + [i64] * 5
    lib.rotary_cache_write.restype = None
    lib.silu_mul_f32.argtypes = [i64, ptr, ptr, i64, i64]
    lib.silu_mul_f32.restype = None
    lib.rms_norm_f32.argtypes = [i64, ptr, ptr, ptr, i64, ctypes.c_float, i64]
    lib.rms_norm_f32.restype = None
    lib.rms_norm_bf16.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, i64, ctypes.c_float, i64, i64]
    lib.rms_norm_bf16.restype = None
    lib.aten_order_row_sums.argtypes = [i64, ptr, ptr, i64, i64]
    lib.aten_order_row_sums.restype = None
    lib.silu_mul_bf16.argtypes = [i64, ptr, ptr, i64, ptr, i64]
    lib.silu_mul_bf16.restype = None
    lib.argmax_rows.argtypes = [i64, ptr, i64, i64, i64, ptr, i64]
    lib.argmax_rows.restype = None
    lib.amx_ready.argtypes = []
    lib.amx_ready.restype = i64
    lib.amx_pack_bf16.argtypes = [ptr, ptr, i64, i64]
    lib.amx_pack_bf16.restype = None
    lib.gemm_amx_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
    lib.gemm_amx_bf16.restype = None
    lib.dpbf16_ready.argtypes = []
    lib.dpbf16_ready.restype = i64
    lib.gemm_dpbf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
    lib.gemm_dpbf16.restype = None
    for name in ("transpose_2byte", "transpose_4byte"):
        getattr(lib, name).argtypes = [ptr, ptr, i64, i64, i64, i64]
        getattr(lib, name).restype = None
    return lib


def build_id() -> str | None:
    """Which build of the kernels is loaded (source, CPU, compiler and flags), None without one: measurements
    of them (the GEMM plan) are keyed by it."""
    lib = library()
    return Path(lib._name).stem if lib is not None else None


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("native kernels are not available on this machine")
    return lib


def is_available() -> bool:
    return library() is not None


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) fp32 -> the kernels' layout: (out_pad / 16, in, 16), out padded with zeros to whole tiles."""
    lib = _required()
    size_out, size_in = weight.shape
    pad = -size_out % lib.native_tile_outputs()
    w = torch.cat([weight, weight.new_zeros(pad, size_in)]) if pad else weight
    tiles = w.view(-1, 16, size_in).transpose(1, 2)
    return huge_pages.empty(tiles.shape, weight.dtype).copy_(tiles)  # streamed every step: on huge pages


def linear(x: torch.Tensor, packed: torch.Tensor, size_out: int, name: str = "gemm") -> torch.Tensor:
    """x (T, in) fp32 @ weightᵀ -> (T, size_out), with `packed` = pack(weight)."""
    return _gemm(_required().gemm_blocked_f32, x, packed, size_out, torch.float32, name)


def _gemm(kernel: Any, x: torch.Tensor, packed: torch.Tensor, size_out: int, dtype: torch.dtype,
          name: str) -> torch.Tensor:
    """A native GEMM `kernel(x, packed, y, rows, in, out, threads)` into a new (rows, size_out) `dtype` tensor."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], size_out, dtype=dtype)
    with traced(f"native::{name}"):
        kernel(x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], size_out, torch.get_num_threads())
    return y


def _tileable_bf16(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight (out, in), both sides multiples of 32: what the tile-packed kernels (AMX, AVX512-BF16) take."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0)


def supports_amx(weight: torch.Tensor) -> bool:
    """Whether the AMX bf16 GEMM takes this weight (`_tileable_bf16`) on a build with AMX (`-march=native` on a CPU
    with AMX-BF16) whose OS lets the process use the tile registers. DSPARK_AMX=0 in the environment takes it out of
    the candidates (the plan is then measured again, without it)."""
    if os.environ.get(AMX_ENV, "1") == "0":
        return False
    lib = library()
    return lib is not None and _tileable_bf16(weight) and bool(lib.amx_ready())


def supports_dpbf16(weight: torch.Tensor) -> bool:
    """Whether the AVX512-BF16 GEMM (VDPBF16PS, for CPUs without AMX such as Zen 4) takes this weight
    (`_tileable_bf16`) on a build with AVX512-BF16 (`-march=native` on such a CPU)."""
    lib = library()
    return lib is not None and _tileable_bf16(weight) and bool(lib.dpbf16_ready())


def dpbf16_linear(x: torch.Tensor, packed: torch.Tensor, size_out: int, name: str = "gemm") -> torch.Tensor:
    """x (T, in) bf16 @ weightᵀ -> (T, size_out) bf16 on AVX512-BF16, with `packed` = amx_pack(weight) (the same
    layout)."""
    return _gemm(_required().gemm_dpbf16, x, packed, size_out, torch.bfloat16, name)


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) bf16 -> the AMX kernel's layout: (out / 16, in / 32, 16, 16, 2), one B tile per block."""
    lib = _required()
    weight = weight.contiguous()
    packed = huge_pages.empty((weight.numel(),), torch.bfloat16)  # streamed every step: on huge pages
    lib.amx_pack_bf16(weight.data_ptr(), packed.data_ptr(), weight.shape[0], weight.shape[1])
    return packed


def amx_linear(x: torch.Tensor, packed: torch.Tensor, size_out: int, name: str = "gemm") -> torch.Tensor:
    """x (T, in) bf16 @ weightᵀ -> (T, size_out) bf16, with `packed` = amx_pack(weight)."""
    return _gemm(_required().gemm_amx_bf16, x, packed, size_out, torch.bfloat16, name)


def supports_attention(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the native attention (and the fused stack, which uses it) takes this shape and dtype."""
    return (is_available() and dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0
            and head_dim <= 256 and num_heads % num_kv_heads == 0)


def attention(qk: torch.Tensor, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
              key_row: torch.Tensor, num_keys: torch.Tensor, max_keys: int, scale: float) -> torch.Tensor:
    """Attention of T tokens, each over its own cache slot: (T, num_heads * head_dim), in qk's dtype (fp32,
    or bf16 with the arithmetic in fp32).

    qk: contiguous (T, heads, head_dim) whose first num_heads heads are the queries (k, v may follow); the cache
    (slots, max_len, num_kv_heads, head_dim) in qk's dtype; token t reads num_keys[t] keys from flat row
    key_row[t]."""
    lib = _required()
    num_tokens, heads, head_dim = qk.shape
    fn = lib.attention_bf16 if qk.dtype == torch.bfloat16 else lib.attention_f32
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=qk.dtype)
    probs = torch.empty(num_tokens * num_heads * max_keys, dtype=torch.float32)
    with traced("native::attention"):
        fn(num_tokens, qk.data_ptr(), heads * head_dim, k_cache.data_ptr(), v_cache.data_ptr(), key_row.data_ptr(),
           num_keys.data_ptr(), out.data_ptr(), probs.data_ptr(), num_heads, k_cache.shape[2], head_dim, scale,
           max_keys, torch.get_num_threads())
    return out


def rotary_cache_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, cache_row: torch.Tensor, num_heads: int) -> None:
    """In place on a step's q|k|v rows (T, (num_heads + 2 kv) * head_dim), contiguous, fp32 or bf16: the rotary
    embedding on q and k (cos/sin (T, head_dim) in qkv's dtype), then k and v into the caches (slots, max_len,
    kv, head_dim) at flat rows cache_row (T,)."""
    lib = _required()
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    with traced("native::rotary_cache_write"):
        lib.rotary_cache_write(qkv.shape[0], qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), cache_row.data_ptr(), num_heads, num_kv, head_dim,
                               int(qkv.dtype == torch.bfloat16), torch.get_num_threads())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows (T, d), as F.rms_norm(x, (d,), weight, eps); of bf16 rows (where `bf16_norm_lanes`
    is not None) to the bit as F.rms_norm rounds them."""
    if x.dtype == torch.bfloat16:
        return _norm_bf16(x, None, weight, eps, _lanes())[1]
    lib = _required()
    x = x.contiguous()
    out = torch.empty_like(x)
    with traced("native::rms_norm"):
        lib.rms_norm_f32(x.shape[0], x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[1], eps,
                         torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm(x + residual)) of bf16 rows (T, d) in one pass, to the bit as `x + residual` and
    F.rms_norm on that sum round them (where `bf16_norm_lanes` is not None). Both are new tensors (x may be a
    hidden state kept for the drafter)."""
    total, out = _norm_bf16(x, residual, weight, eps, _lanes())
    assert total is not None
    return total, out


def _lanes() -> int:
    lanes = bf16_norm_lanes()
    if lanes is None:
        raise RuntimeError("no native bf16 norm that rounds as torch's does on this machine (bf16_norm_lanes)")
    return lanes


def _norm_bf16(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
               lanes: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    lib = _required()
    x = x.contiguous()
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    residual = None if residual is None else residual.contiguous()
    with traced("native::rms_norm_bf16"):
        lib.rms_norm_bf16(x.shape[0], x.data_ptr(), None if residual is None else residual.data_ptr(),
                          None if total is None else total.data_ptr(), weight.data_ptr(), out.data_ptr(),
                          x.shape[1], eps, lanes, torch.get_num_threads())
    return total, out


def aten_order_row_sums(x: torch.Tensor, lanes: int) -> torch.Tensor:
    """Row sums of fp32 rows (T, n) added in the order of aten's CPU sum kernel with vectors of `lanes` floats."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32)
    _required().aten_order_row_sums(x.shape[0], x.data_ptr(), out.data_ptr(), x.shape[1], lanes)
    return out


@functools.cache
def bf16_norm_lanes() -> int | None:
    """The vector width (floats) of the sum kernel torch dispatches to on this CPU, which the bf16 norm needs to
    add its squares in torch's order; None (the norm stays PyTorch's) where no width reproduces torch.sum to the
    bit, or the native norm then differs from `x + r` and F.rms_norm on random rows. Found once per process (a
    few ms): the width is torch's build and dispatch choice (on a Zen 4 with AVX-512, torch 2.13 sums with 8
    lanes), not the CPU's. The probes cover short rows, leftover vectors and scalars, and the cascade's levels."""
    if library() is None:
        return None
    gen = torch.Generator().manual_seed(0)
    probes = [torch.rand(32, n, generator=gen) * 2.0 ** torch.randint(-8, 8, (32, 1), generator=gen)
              for n in (5, 100, 576, 1000, 4104, 70000)]
    x = (torch.randn(512, 576, generator=gen) * 4).to(torch.bfloat16)
    r = torch.randn(512, 576, generator=gen).to(torch.bfloat16)
    w = (torch.randn(576, generator=gen) * 0.3 + 1).to(torch.bfloat16)
    for lanes in (16, 8, 4):
        if all(torch.equal(aten_order_row_sums(p, lanes), p.sum(-1)) for p in probes):
            total, normed = _norm_bf16(x, r, w, 1e-5, lanes)
            if torch.equal(total, x + r) and torch.equal(normed, F.rms_norm(x + r, (576,), w, 1e-5)):
                return lanes
    log.info("native bf16 norm off: no sum order of 16, 8 or 4 lanes reproduces torch's here")
    return None


def row_major(x: torch.Tensor) -> torch.Tensor:
    """x (N, M) as a contiguous tensor. A transposed view (strides (1, S), S >= N: W @ xᵀ's output) is copied by
    the native tiled transpose, several times faster than PyTorch's strided copy on 2-byte elements; anything
    else, and every case without the native kernels, by `contiguous`."""
    lib = library()
    if (x.is_contiguous() or lib is None or x.dim() != 2 or x.device.type != "cpu" or x.stride(0) != 1
            or x.stride(1) < x.shape[0] or x.element_size() not in (2, 4)):
        return x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel = lib.transpose_2byte if x.element_size() == 2 else lib.transpose_4byte
    with traced("native::row_major"):  # x's storage: (M, S) row-major, its first N columns are x's rows
        kernel(x.data_ptr(), out.data_ptr(), x.shape[1], x.shape[0], x.stride(1), torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of fp32 rows (T, 2 inter) laid out gate | up: (T, inter), one pass (PyTorch takes three: the
    chunk, the SiLU and the product); of bf16 rows (where `silu_bf16_table` is not None) to the bit as those three
    round them."""
    lib = _required()
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    with traced("native::silu_mul"):
        if gate_up.dtype == torch.bfloat16:
            table = silu_bf16_table()
            if table is None:
                raise RuntimeError("no native bf16 SiLU that rounds as torch's does on this machine")
            _silu_mul_bf16(lib, gate_up, out, table)
        else:
            lib.silu_mul_f32(gate_up.shape[0], gate_up.data_ptr(), out.data_ptr(), inter, torch.get_num_threads())
    return out


def _silu_mul_bf16(lib: ctypes.CDLL, gate_up: torch.Tensor, out: torch.Tensor, table: torch.Tensor) -> None:
    lib.silu_mul_bf16(gate_up.shape[0], gate_up.data_ptr(), out.data_ptr(), out.shape[1], table.data_ptr(),
                      torch.get_num_threads())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.max(dim=-1).indices of fp32 or bf16 CPU rows (T, V) whose rows are contiguous (the first of equal
    maxima; a row's first NaN where it has one), in one native pass over each row. Anything else: torch's."""
    lib = library()
    if (lib is None or logits.dim() != 2 or logits.device.type != "cpu" or logits.stride(-1) != 1
            or logits.dtype not in (torch.float32, torch.bfloat16) or logits.shape[1] == 0):
        return logits.max(dim=-1).indices
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    with traced("native::argmax_rows"):
        lib.argmax_rows(logits.shape[0], logits.data_ptr(), logits.shape[1], logits.stride(0),
                        int(logits.dtype == torch.bfloat16), out.data_ptr(), torch.get_num_threads())
    return out


@functools.cache
def silu_bf16_table() -> torch.Tensor | None:
    """PyTorch's bf16 SiLU of every one of the 65536 bf16 values, widened to fp32 (256 KB, built with F.silu once
    per process): the native bf16 SiLU·up looks its SiLU up here, so it is torch's by construction. None (the
    MLP stays on PyTorch's ops) without the native kernels, or where the native pass then differs from
    F.silu(gate) * up on random rows (torch's SiLU would depend on where a value sits in a tensor)."""
    if library() is None:
        return None
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    table = F.silu(every).float().contiguous()
    gen = torch.Generator().manual_seed(0)
    for rows, inter in ((1, 1536), (37, 1536), (5, 1000)):
        gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.empty(rows, inter, dtype=torch.bfloat16)
        _silu_mul_bf16(library(), gate_up, out, table)
        if not torch.equal(out, F.silu(gate) * up):
            log.info("native bf16 SiLU·up off: its result differs from torch's here")
            return None
    return table


@dataclass
class Candidates:
    """`nucleus_candidates`' result for N rows: row r's candidates are idx[r, :count[r]] (when count[r] <= cap)."""

    argmax: list[int]
    total: torch.Tensor  # (N,) float64: sum of the row's unnormalised weights exp((x - max) / T)
    count: list[int]
    idx: torch.Tensor  # (N, cap) int32
    weight: torch.Tensor  # (N, cap) float32: their unnormalised weights


def nucleus_candidates(logits: torch.Tensor, temperature: list[float], frac: list[float], cap: int) -> Candidates:
    """Per row of logits (N, V), fp32 or bf16, contiguous: the argmax, the total weight, and the tokens whose
    weight exceeds frac[r] x total (see spec/nucleus.py), in one native pass per row. temperature 0: argmax only."""
    lib = _required()
    num_rows, vocab = logits.shape
    argmax = torch.empty(num_rows, dtype=torch.int64)
    total = torch.empty(num_rows, dtype=torch.float64)
    count = torch.empty(num_rows, dtype=torch.int64)
    idx = torch.empty(num_rows, cap, dtype=torch.int32)
    weight = torch.empty(num_rows, cap, dtype=torch.float32)
    temp = torch.tensor(temperature, dtype=torch.float32)
    frac_t = torch.tensor(frac, dtype=torch.float64)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads * vocab, dtype=torch.float32)
    with traced("native::nucleus_candidates"):
        lib.nucleus_candidates(num_rows, vocab, logits.data_ptr(), int(logits.dtype == torch.bfloat16),
                               temp.data_ptr(), frac_t.data_ptr(), argmax.data_ptr(), total.data_ptr(), cap,
                               idx.data_ptr(), weight.data_ptr(), count.data_ptr(), scratch.data_ptr(), threads)
    return Candidates(argmax.tolist(), total, count.tolist(), idx, weight)


class FusedDecoder:
    """The whole decoder stack for a few fp32 tokens in one native call (`decoder_stack_f32`): per layer the
    norms, q|k|v, rotary, K/V write, attention over each token's own slot, o, SiLU·up and down, with no
    PyTorch op in between and one OpenMP region for all layers. Built from the runner's fused weights; the
    cache is passed per call (the runner swaps in scratch caches)."""

    def __init__(self, layers: list, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 scale: float) -> None:
        self._fn = _required().decoder_stack_f32
        self.layers = layers  # keeps the weights alive while their addresses are held below
        self._weights = torch.tensor([p for ly in layers for p in (
            ly.in_norm.data_ptr(), ly.qkv.native_weight().data_ptr(), ly.o.native_weight().data_ptr(),
            ly.post_norm.data_ptr(), ly.gate_up.native_weight().data_ptr(), ly.down.native_weight().data_ptr())],
            dtype=torch.int64)
        self.num_layers = len(layers)
        self.d = layers[0].in_norm.shape[0]
        self.inter = layers[0].down.weight.shape[1]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.scale = eps, scale
        self._cache_ptrs: tuple[list, list, torch.Tensor, torch.Tensor] | None = None  # (k list, v list, ptrs)
        self._hidden_flags: dict[tuple[int, ...], torch.Tensor] = {}

    def _pointers(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches' per-layer addresses, rebuilt only when the runner swaps in another cache."""
        memo = self._cache_ptrs
        if memo is None or memo[0] is not k_cache or memo[1] is not v_cache:
            memo = (k_cache, v_cache, torch.tensor([k.data_ptr() for k in k_cache], dtype=torch.int64),
                    torch.tensor([v.data_ptr() for v in v_cache], dtype=torch.int64))
            self._cache_ptrs = memo
        return memo[2], memo[3]

    @staticmethod
    def supports(layers: list) -> bool:
        """fp32 CPU weights without biases (Llama, Mistral); anything else takes the PyTorch path."""
        ly = layers[0]
        return (is_available() and ly.qkv.weight.dtype == torch.float32 and ly.qkv.weight.device.type == "cpu"
                and all(lin.bias is None for lin in (ly.qkv, ly.o, ly.gate_up, ly.down))
                and ly.in_norm.is_contiguous())

    def forward(self, x: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                cache_row: torch.Tensor, key_row: torch.Tensor, num_keys: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, max_keys: int, hidden_layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """Every layer in place on x (T, d); returns x after each layer i + 1 in `hidden_layers` (i >= 0).
        The int64 index tensors and cos/sin (T, head_dim) contiguous."""
        num_tokens = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_token = self.d + nq + 2 * nkv + nq + 3 * self.inter + self.num_heads * max_keys
        scratch = torch.empty(num_tokens * per_token, dtype=torch.float32)
        is_hidden = self._hidden_flags.get(hidden_layers)
        if is_hidden is None:
            is_hidden = torch.tensor([int(i + 1 in hidden_layers) for i in range(self.num_layers)], dtype=torch.int64)
            self._hidden_flags[hidden_layers] = is_hidden
        hidden = torch.empty(self.num_layers if hidden_layers else 1, num_tokens, self.d)
        k_ptrs, v_ptrs = self._pointers(k_cache, v_cache)
        with traced("native::decoder_stack"):
            self._fn(num_tokens, x.data_ptr(), scratch.data_ptr(), self.num_layers, self._weights.data_ptr(),
                     k_ptrs.data_ptr(), v_ptrs.data_ptr(), cache_row.data_ptr(), key_row.data_ptr(),
                     num_keys.data_ptr(), cos.data_ptr(), sin.data_ptr(), self.d, self.num_heads, self.num_kv_heads,
                     self.head_dim, self.inter, self.eps, self.scale, max_keys, hidden.data_ptr(),
                     is_hidden.data_ptr(), torch.get_num_threads())
        return {i: hidden[i - 1] for i in hidden_layers if i > 0}
