"""Side-by-side A/B of native kernel builds in one process (the scripts under docs/results that compare a change to
`native_kernels.c` with a base commit's): each source built and loaded as `native.library()` does, one made current
at a time, and each variant timed in turns whose order alternates, so a slow spell of a shared host lands on every
variant rather than on whichever ran then."""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from dspark.kernels import native


def kernel_libraries(base_commit: str, defines: dict[str, dict[str, str]] | None = None,
                     module: ModuleType = native) -> dict[str, ctypes.CDLL]:
    """"base": `module`'s C source (`native_kernels.c`, or `suffix_native`'s `suffix_kernels.c`) at `base_commit`,
    "head": this checkout's, and one more per `defines` entry (name -> macros set before this checkout's source), each
    built and loaded as `module.library()` builds and loads it."""
    tmp = Path(tempfile.mkdtemp())
    head = module.SOURCE
    base = subprocess.run(["git", "show", f"{base_commit}:dspark/kernels/{head.name}"], capture_output=True,
                          text=True, check=True).stdout
    (tmp / "base.c").write_text(base)
    sources = {"base": tmp / "base.c", "head": head}
    for name, macros in (defines or {}).items():
        (tmp / f"{name}.c").write_text("".join(f"#define {k} {v}\n" for k, v in macros.items()) + head.read_text())
        sources[name] = tmp / f"{name}.c"
    libs = {}
    try:
        for name, src in sources.items():
            module.SOURCE = src
            module.library.cache_clear()
            libs[name] = module.library()
    finally:  # this checkout's source again, and its library for the next `library()` (not the last built)
        module.SOURCE = head
        module.library.cache_clear()
    if any(lib is None for lib in libs.values()):
        raise RuntimeError(f"a native build failed: {[n for n, lib in libs.items() if lib is None]}")
    return libs


def use_library(libs: dict[str, ctypes.CDLL], name: str, module: ModuleType = native) -> None:
    """Make `libs[name]` the library every call of this process into `module`'s kernels goes to (the runner's, the
    suffix drafter's included): its `library()` and the accessor its callers use (`_required` / `required`)."""
    module.library = lambda: libs[name]  # type: ignore[attr-defined]
    for accessor in ("_required", "required"):
        if hasattr(module, accessor):
            setattr(module, accessor, lambda: libs[name])


def turns_ms(variants: dict[str, Callable[[], None]], turns: int, min_s: float = 0.0,
             warmup: int = 0) -> dict[str, float]:
    """Median ms of one call of each variant over `turns` turns, the order reversed every other turn; a turn calls a
    variant `warmup` times untimed, then once, or repeatedly for at least `min_s` seconds (its mean per call)."""
    times: dict[str, list[float]] = {n: [] for n in variants}
    for turn in range(turns):
        for name in (list(variants) if turn % 2 == 0 else list(variants)[::-1]):
            for _ in range(warmup):
                variants[name]()
            n, t0 = 0, time.perf_counter()
            while True:
                variants[name]()
                n += 1
                if time.perf_counter() - t0 >= min_s:
                    break
            times[name].append((time.perf_counter() - t0) / n * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}
