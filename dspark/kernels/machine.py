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
    """CPU model, the instruction-set flags that decide kernel speed (AVX2 / AVX-512 / AMX) and, where the kernel
    reports it, the microarchitecture as CPUID family and model (`cpuid`, e.g. "25-17"): a virtual machine may name
    every AMD EPYC alike, yet a Zen 4 (family 25) runs AVX-512 on 256-bit units and a Zen 5 (family 26) on 512-bit
    ones, and a verify step of 64 tokens takes ~1.8x as long on the first (docs/results/suffix/s59/profile)."""
    model, flags, cpuid = _read_cpu()
    return {"model": model, "flags": list(flags), **({"cpuid": cpuid} if cpuid else {})}


def same_cpu(recorded: dict, here: dict) -> bool:
    """Whether what a cache or profile `recorded` describes this CPU (`here`, a `cpu_signature()`): the same model
    name and flags, and the same CPUID family and model where the record names them (one measured before they
    were recorded matches by name and flags)."""
    return recorded.get("model") == here.get("model") and list(recorded.get("flags", ())) == \
        list(here.get("flags", ())) and ("cpuid" not in recorded or recorded["cpuid"] == here.get("cpuid"))


@functools.cache
def _read_cpu() -> tuple[str, tuple[str, ...], str | None]:  # /proc/cpuinfo once per process
    model, flags, fields = platform.processor() or platform.machine(), set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value
            elif key in ("cpu family", "model"):
                fields.setdefault(key, value)
            elif key == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    cpuid = f"{fields['cpu family']}-{fields['model']}" if len(fields) == 2 else None
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
    if os.environ.get(ISA_ENV, "").lower() == "avx2" and "avx2" in flags:  # an AVX2-only CPU, emulated
        return f"{model} (as avx2)", ("avx2",), cpuid
    return model, tuple(f for f in wanted if f in flags), cpuid


def has_bf16_units() -> bool:
    """True where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX); elsewhere bf16 is emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_signature()["flags"]))
