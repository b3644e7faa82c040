"""CPU tensors on transparent huge pages (2 MiB), for what a step streams from DRAM: the packed weights and the KV
cache.

Why: a verify step reads every weight once (268 MB for SmolLM2-135M in bf16) and each request's cached keys and
values. On 4 KiB pages that is ~65,000 pages a step; the CPUs' stream prefetchers stop at every 4 KiB boundary and
each new page costs a TLB walk. 2-core Zen 4 EPYC, SmolLM2 bf16 (docs/results/suffix/s52/huge_pages): all of its
GEMMs 0.86-0.95x the time at 1-32 rows (`gemm_pages_ab.c`), the forward 0.97-0.99x, in the engine target-only
+5 / +5 / +10 % tokens/s and the hybrid +4 / +3 / +2 % at batch 1 / 4 / 8. PyTorch's allocator gives large tensors
plain `mmap`ed memory, which the kernel backs with huge pages only where the system's THP mode is `always`; the
usual mode is `madvise` (an application asks per range), so this module asks: anonymous `mmap`,
`madvise(MADV_HUGEPAGE)`, a tensor over it.

Small tensors share arenas (`ARENA_BYTES` each, carved in `ALIGN`-byte steps) so a 1 MB weight does not take a
whole 2 MiB page; an arena's mapping lives while any tensor carved from it does (each tensor holds a reference to
it). Where huge pages cannot be had (no `MADV_HUGEPAGE` in this Python, THP `never`, another OS) the tensors are
plain ones on whatever pages the system gives: the same values, only slower. DSPARK_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "DSPARK_HUGE_PAGES"
HUGE_PAGE = 2 << 20
ARENA_BYTES = 64 << 20  # 32 huge pages; a tensor larger than half of it gets its own mapping
ALIGN = 4096  # every tensor starts on a 4 KiB boundary (cache lines and the kernels' 64-byte loads)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_lock = threading.Lock()
_arena: list = [None, 0, 0]  # the current arena: [its mmap, offset of its free space, offset of its end]


def available() -> bool:
    """Whether tensors from `empty` / `zeros` ask for huge pages here (Linux, THP not `never`, not switched off)."""
    if os.environ.get(ENV, "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def _mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of `nbytes` + one huge page (so a 2 MiB-aligned start fits), advised huge."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    return mm


def _aligned_start(mm: mmap.mmap) -> int:
    """Offset of the first 2 MiB boundary in `mm`."""
    base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
    return -base % HUGE_PAGE


def _carve(nbytes: int) -> torch.Tensor:
    """`nbytes` bytes (uint8) of huge-page-advised memory, zero-filled (fresh anonymous pages)."""
    if nbytes > ARENA_BYTES // 2:
        mm = _mapping(nbytes)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=_aligned_start(mm))
    with _lock:
        mm, used, end = _arena
        if mm is None or used + nbytes > end:
            mm = _mapping(ARENA_BYTES)
            used = _aligned_start(mm)
            end = used + ARENA_BYTES
        out = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=used)
        _arena[:] = [mm, used + -(-nbytes // ALIGN) * ALIGN, end]
    return out


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` and `dtype` on huge pages where `available()`, else `torch.empty`."""
    numel = math.prod(shape)
    if not available() or numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    try:
        return _carve(numel * dtype.itemsize).view(dtype).view(tuple(shape))
    except (OSError, ValueError, RuntimeError) as e:  # mmap refused (limits): plain pages
        log.warning("huge pages unavailable (%s): plain pages", e)
        return torch.empty(tuple(shape), dtype=dtype)


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """`empty`, zero-filled (anonymous pages are zero already; this says so and costs one pass)."""
    return empty(shape, dtype).zero_()
