"""The suffix proposer's kernels (`suffix_kernels.c`), compiled on first use and cached like the engine's.

Why native: a proposal is a few binary searches over a 10M-entry suffix array plus a walk, per request and
step; in Python that is ~0.5 ms a request, in C a few microseconds, which is what keeps proposing for a
whole batch a small fraction of one verify step. The kernels are plain C (no OpenMP, no ISA flags beyond
`-O2`), so they build wherever a compiler is; without one `library()` is None and the suffix drafter says
so when it is made.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from dspark.kernels.cache_once import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("suffix_kernels.c")
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c11")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled suffix kernels, or None without a C compiler (logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not SOURCE.exists():
        log.warning("suffix kernels unavailable: no C compiler (set CC) or source missing")
        return None
    source = SOURCE.read_bytes()
    out = cache_dir() / "native" / f"suffix-{hashlib.sha256(source + repr(CFLAGS).encode()).hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")  # per process: concurrent builders never share a file
        res = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        if res.returncode != 0:
            log.warning("suffix kernels failed to build:\n%s", res.stderr[-2000:])
            tmp.unlink(missing_ok=True)
            return None
        tmp.replace(out)  # atomic: a concurrent builder's identical file may win, either is fine
    lib = ctypes.CDLL(str(out))
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.suffix_walk.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, f32, i64] + [ptr] * 6
    lib.suffix_walk.restype = i64
    lib.request_walk.argtypes = [ptr, i64, i64, i64, i64, f32, i64] + [ptr] * 7
    lib.request_walk.restype = i64
    lib.propose_batch.argtypes = ([i64, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, f32, i64, i64,
                                   ptr, i64, i64, i64, ptr] + [ptr] * 8)
    lib.propose_batch.restype = None
    lib.sample_batch.argtypes = ([i64, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, f32, i64, i64,
                                  ptr, i64, ptr, ptr, ptr] + [ptr] * 8)
    lib.sample_batch.restype = None
    return lib


def required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the suffix proposer needs a C compiler for its kernels (install gcc, or set CC)")
    return lib
