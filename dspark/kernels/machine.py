"""What this machine is, for the caches keyed by it: the CPU model and the ISA flags that decide kernel speed."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# DSPARK_CPU_ISA=avx2 runs this machine as an AVX2-only CPU: the signature (profiles, plans, bf16 candidates)
# names only avx2 and the native kernels are built for x86-64-v3. Set PyTorch's own ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 with it (before torch is imported) for the library
# kernels to follow.
ISA_ENV = "DSPARK_CPU_ISA"


def cpu_signature() -> dict:
    """CPU model and the instruction-set flags that decide kernel speed (AVX2 / AVX-512 / AMX)."""
    model, flags = _read_cpu()
    return {"model": model, "flags": list(flags)}


@functools.cache
def _read_cpu() -> tuple[str, tuple[str, ...]]:  # /proc/cpuinfo once per process
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
    if os.environ.get(ISA_ENV, "").lower() == "avx2" and "avx2" in flags:  # an AVX2-only CPU, emulated
        return f"{model} (as avx2)", ("avx2",)
    return model, tuple(f for f in wanted if f in flags)


def has_bf16_units() -> bool:
    """True where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX); elsewhere bf16 is emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_signature()["flags"]))
