"""OpenMP thread teams: one per thread that ever ran a parallel region, kept for the process's life.

A Serve replica loads and warms its model on its constructor's thread and then computes on its engine
thread; each got a team. GNU OpenMP counts the threads of every team, and where they outnumber the cores it
cuts its spin-wait to almost nothing: a team's workers then sleep between the thousands of small parallel
regions of a decode step and each region pays a futex wake-up. Measured on a 2-core Xeon (session 30),
bf16 SmolLM2 decode at batch 1: 35 tok/s on the thread that loaded it, 21 tok/s on a second thread, and
39-40 on the second thread once the first thread's team was released (`release`): the engine loop, and
a draft link, release the teams before they start computing.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads themselves (OpenMP 5.0)
_RUNTIMES = ("libgomp", "libiomp", "libomp")


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process loaded (torch's own copy), found in /proc/self/maps."""
    import torch  # noqa: F401 - loads the runtime torch links against

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if any(r in line for r in _RUNTIMES) and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all  # noqa: B018 - present from OpenMP 5.0 runtimes on
            return lib
        except (OSError, AttributeError):
            continue
    return None


def release() -> bool:
    """Free every thread's OpenMP team (call while nothing computes); the next parallel region on a thread
    builds that thread's team again. False where the runtime cannot (none loaded, or pre-5.0)."""
    lib = _runtime()
    if lib is None:
        return False
    ok = lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
    if not ok:
        log.debug("omp_pause_resource_all refused: OpenMP teams kept")
    return ok
