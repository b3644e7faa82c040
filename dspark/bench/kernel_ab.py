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

from dspark.kernels import native


def kernel_libraries(base_commit: str, defines: dict[str, dict[str, str]] | None = None) -> dict[str, ctypes.CDLL]:
    """"base": `native_kernels.c` at `base_commit`, "head": this checkout's, and one more per `defines` entry (name ->
    macros set before this checkout's source), each built and loaded as `native.library()` builds and loads it."""
    tmp = Path(tempfile.mkdtemp())
    base = subprocess.run(["git", "show", f"{base_commit}:dspark/kernels/native_kernels.c"], capture_output=True,
                          text=True, check=True).stdout
    (tmp / "base.c").write_text(base)
    head = native.SOURCE
    sources = {"base": tmp / "base.c", "head": head}
    for name, macros in (defines or {}).items():
        (tmp / f"{name}.c").write_text("".join(f"#define {k} {v}\n" for k, v in macros.items()) + head.read_text())
        sources[name] = tmp / f"{name}.c"
    libs = {}
    try:
        for name, src in sources.items():
            native.SOURCE = src
            native.library.cache_clear()
            libs[name] = native.library()
    finally:  # this checkout's source again, and its library for the next `native.library()` (not the last built)
        native.SOURCE = head
        native.library.cache_clear()
    if any(lib is None for lib in libs.values()):
        raise RuntimeError(f"a native build failed: {[n for n, lib in libs.items() if lib is None]}")
    return libs


def use_library(libs: dict[str, ctypes.CDLL], name: str) -> None:
    """Make `libs[name]` the library every native call of this process goes to (the runner's included)."""
    native.library = lambda: libs[name]  # type: ignore[assignment]
    native._required = lambda: libs[name]  # type: ignore[assignment]


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
