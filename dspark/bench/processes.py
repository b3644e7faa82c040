"""What the processes of a benchmark session use: every Ray process on the machine, HAProxy and the load
generator, by process title (RSS, CPU seconds), sampled while a phase runs. (The load itself comes from
processes of its own with no garbage collection mid-phase, `load_procs.py`.)"""

from __future__ import annotations

import threading
from collections.abc import Callable

import psutil


def is_ray_process(cmd: str) -> bool:
    """A Ray process by its command line: raylet, GCS, dashboard and its agents, workers (`ray::...`)."""
    return "ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or "ray/_private" in cmd or "ray/dashboard" in cmd


def session_processes() -> list[tuple[str, psutil.Process]]:
    """This process and its children ("load generator": the load processes), every Ray process on the
    machine (raylet, GCS, workers, replicas) and HAProxy ("haproxy", started by Serve), each with its title
    (`ray::ServeReplica:dspark:dspark-verify`, `ray::ProxyActor`, `raylet`)."""
    me = psutil.Process()
    out: list[tuple[str, psutil.Process]] = [("load generator", me)]
    mine = {me.pid}
    try:
        for child in me.children():  # Ray's own children (raylet, GCS) are counted below, by title
            if child.name() != "haproxy" and not is_ray_process(" ".join(child.cmdline())):
                out.append(("load generator", child))
                mine.add(child.pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.pid in mine:
                continue
            if proc.info["name"] == "haproxy":
                out.append(("haproxy", proc))
            elif is_ray_process(cmd):
                # a busy replica's title names its method (`...dspark-verify.handle_request`): one key per process
                title = cmd.split()[0].split(".")[0] if cmd.startswith("ray::") else (proc.info["name"] or "ray")
                out.append((title, proc))
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return out


def by_process(measure: Callable[[psutil.Process], float]) -> dict[str, float]:
    """`measure(process)` summed by process title (processes that went away meanwhile are left out)."""
    out: dict[str, float] = {}
    for title, proc in session_processes():
        try:
            out[title] = out.get(title, 0.0) + measure(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def session_rss_by_process() -> dict[str, float]:
    """RSS (MiB) by process title."""
    return by_process(lambda p: p.memory_info().rss / 2**20)


def session_cpu_by_process() -> dict[str, float]:
    """CPU seconds (user + system) used so far, by process title."""
    return by_process(lambda p: sum(p.cpu_times()[:2]))


def cpu_used(before: dict[str, float], after: dict[str, float], num_requests: int) -> dict[str, float]:
    """CPU ms per request sent, by process, between two snapshots (largest first; under 0.05 ms left out):
    where a phase's work went (the HTTP path, the compute pools, the load generator itself)."""
    used = {k: (v - before.get(k, 0.0)) * 1e3 / max(num_requests, 1) for k, v in after.items()}
    return {k: round(v, 2) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def session_rss_mb() -> float:
    return sum(session_rss_by_process().values())


class RssSampler:
    """Total RSS every `interval_s`; the per-process breakdown at the start and at the peak."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s, self.samples = interval_s, []
        self.first: dict[str, float] = {}
        self.at_peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            by_proc = session_rss_by_process()
            total = sum(by_proc.values())
            if not self.samples:
                self.first = by_proc
            if not self.samples or total > max(self.samples):
                self.at_peak = by_proc
            self.samples.append(total)
            self._stop.wait(self.interval_s)

    def growth_by_process(self) -> dict[str, float]:
        """MiB each process grew by from the first sample to the peak, largest first."""
        grown = {k: round(v - self.first.get(k, 0.0), 1) for k, v in self.at_peak.items()}
        return dict(sorted(grown.items(), key=lambda kv: -kv[1]))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
