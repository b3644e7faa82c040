"""The peer server (e.g. vLLM) as a process tree the benchmark may pause while our arms take their turn.

An idle server is not always idle on the CPU: OpenMP workers spin for a while after each parallel region,
heartbeat threads wake up, an engine loop polls. On two cores that is the arm under test's time. Pausing
the peer (SIGSTOP to its whole tree, SIGCONT before its own turn) keeps it from spinning; the benchmark
states either way whether it did.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import psutil


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def signal_tree(pid: int, sig: signal.Signals) -> int:
    """Send `sig` to `pid` and all its descendants; how many processes got it."""
    sent = 0
    for proc in _tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.send_signal(sig)
            sent += 1
    return sent


@contextlib.contextmanager
def paused(pid: int | None) -> Iterator[int]:
    """The peer's tree stopped for the duration (no-op for None); yields how many processes were paused.
    Always continued afterwards, also when the body fails."""
    if pid is None:
        yield 0
        return
    n = signal_tree(pid, signal.SIGSTOP)
    try:
        yield n
    finally:
        signal_tree(pid, signal.SIGCONT)
