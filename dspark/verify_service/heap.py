"""Give the C heap's free pages back to the OS (glibc `malloc_trim`).

After a burst of large steps glibc keeps the freed activation buffers mapped, so a replica's resident
memory stays at its busiest level (~100 MB per engine process here). Trimming when the engine goes idle
returns them; a no-op where the C library has no `malloc_trim` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):
    _trim = None


def release_free_memory() -> bool:
    """True when the C library released memory to the OS."""
    return bool(_trim is not None and _trim(0))
