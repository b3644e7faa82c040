"""The fastest dtype per role (verify, draft, generate), measured on this machine, never assumed.

bf16 halves the bytes a step streams, but only CPUs with bf16 units (AVX-512 BF16, AMX) multiply it
natively: on an AVX2-only CPU it is slower than fp32 at every size, and on an AMX Xeon it is slower at
one row and 2x faster at hundreds. So each role is timed at its own operating point:
- verify: a verification-shaped step of one request, 1 + 7 tokens (the batch-1 latency users see);
- draft: one row through the target's layer shapes (a drafter forward is a few rows);
- generate: decode at 128 sequences (offline data generation runs 64-256 at once), with the generation
  path's kernels (not bound to the verify engine's row invariance).
The verify dtype then holds for a whole deployment: the target distribution must not depend on how
many tokens a step carries, so losslessness is always against target-only decoding in that dtype.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from dspark.kernels import cache_once
from dspark.kernels.machine import cpu_signature, has_bf16_units

log = logging.getLogger(__name__)

ROLES = ("verify", "draft", "generate")
# (requests, tokens per request) of each role's step, over a 128-token context
OPERATING_POINTS = {"verify": (1, 8), "draft": (1, 1), "generate": (128, 1)}


def candidate_dtypes(device: str) -> list[str]:
    if str(device).startswith("cuda"):
        return ["bf16", "fp32"]
    return ["fp32", "bf16"] if has_bf16_units() else ["fp32"]


def _step_ms(target_name: str, device: str, dtype: str, num_requests: int, num_tokens: int,
             context_len: int = 128, num_repeats: int = 5, row_invariant: bool = True) -> float:
    """Median step of `num_requests` requests × `num_tokens` tokens over a cached context (the SPS
    profiler's own measurement, at one point), with the kernels of the role's engine."""
    from dspark.models.target.loader import load_target
    from dspark.models.target.profiles import profile_target

    table = profile_target(load_target(target_name, device, dtype), (num_requests * num_tokens,), context_len,
                           tokens_per_request=num_tokens, num_repeats=num_repeats, show_progress=False,
                           row_invariant=row_invariant)
    return table.step_time_ms[0]


def measure_dtypes(target_name: str, device: str = "cpu") -> dict:
    """{"choice": {role: dtype}, "step_ms": {role: {dtype: ms}}, "cpu": ...} for this machine."""
    dtypes = candidate_dtypes(device)
    step_ms: dict[str, dict[str, float]] = {role: {} for role in ROLES}
    for dtype in dtypes:
        for role in ROLES:
            reqs, toks = OPERATING_POINTS[role]
            # each role with its engine's kernels: generation is free of the verify engine's
            # row-invariance constraint (engine.py), so its dtype is measured without it too
            step_ms[role][dtype] = round(_step_ms(target_name, device, dtype, reqs, toks,
                                                  row_invariant=role != "generate"), 2)
    choice = {role: min(step_ms[role], key=step_ms[role].__getitem__) for role in ROLES}
    return {"choice": choice, "step_ms": step_ms, "operating_points": OPERATING_POINTS,
            "cpu": cpu_signature(), "device": device, "torch": torch.__version__}


def chosen_dtype(role: str, target_name: str, device: str, cache_root: Path,
                 recorded: dict | None = None) -> str:
    """The dtype for `role`: from `recorded` (a measurement `dspark profile` stored for this machine),
    else from one cached per machine under cache_root/dtype_choice/ (measured now if absent)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if recorded is not None:
        return recorded["choice"][role]
    if not str(device).startswith("cuda") and not has_bf16_units():
        return "fp32"  # the only candidate: nothing to measure
    cpu = cpu_signature()
    key = "-".join([cpu["model"], *cpu["flags"], cpu.get("cpuid", ""), str(device), Path(target_name).name,
                    torch.__version__, str(torch.get_num_threads())])
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in key)
    path = cache_root / "dtype_choice" / f"{safe}.json"
    cached = cache_once.read_json(path)
    if cached is None:  # measured once per machine: the other processes wait for it, then read it
        with cache_once.locked(f"dtype-choice-{safe}", cache_root):
            cached = cache_once.read_json(path)
            if cached is None:
                t0 = time.perf_counter()
                cached = measure_dtypes(target_name, device)
                log.info("dtype choice measured in %.1f s: %s", time.perf_counter() - t0, cached["choice"])
                cache_once.publish_json(path, cached)
    return cached["choice"][role]
