"""CPU priority on shared cores: the request path before the model.

Where the pools share cores with the front door and the ingress (one machine), admission, 429s and
streaming must answer while the model computes. Ray starts every worker process with its Python threads
at niceness 15 (`RAY_worker_niceness`, so the raylet and GCS keep their CPU), which puts the ingress's
event loop and HAProxy (started by a worker) level with, or below, the pools' compute. The cluster is
started with workers at 0 instead (`REQUEST_PATH_ENV`, read by the raylet from the environment of the
process that starts it), and each pool worker lowers its whole process by its configured `nice`.

Measured (`dspark bench overload`, AMD EPYC, 2 cores, three sustained phases at 10x capacity, behind
HAProxy): refusal p99 374 / 616 / 74 ms before, 19.8 / 16.7 / 10.4 ms with this and the bench's own GC
paused during phases (docs/results/ops/README.md).
"""

from __future__ import annotations

import os

# the environment of the process that starts the cluster: worker processes start at niceness 0
REQUEST_PATH_ENV = {"RAY_worker_niceness": "0"}


def renice_process(increment: int) -> None:
    """Add `increment` to the niceness of every thread of this process (capped at 19). Linux sets
    niceness per thread, and a Ray worker has started many (its event loops, gRPC, Serve's own) before
    a constructor runs; threads started later inherit from their creator."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        os.nice(increment)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
            continue
