"""What this machine is, for the caches keyed by it: the CPU model and the ISA flags that decide kernel speed."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


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
    return model, tuple(f for f in wanted if f in flags)


def has_bf16_units() -> bool:
    """True where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX); elsewhere bf16 is emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_signature()["flags"]))
