"""Who used the cores: CPU seconds by process group between two snapshots, machine-wide.

A serving benchmark on a small machine is only fair when the arm under test had the cores to itself. This
meter says, for a stretch of wall time, how many core-seconds went to each group of processes:
- "load generator": this process (the benchmark's client);
- "arm:<name>": Ray processes whose title names that arm's app (`ray::ServeReplica:dspark-bench-<route>:...`);
- "ray": the other Ray processes (raylet, GCS, Serve controller and proxy, idle workers);
- "peer": a named process and its children (vLLM's server, when its pid is given);
- "other": everything else on the machine (the machine's busy time minus the groups above).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from dspark.bench.processes import is_ray_process


def _group_of(cmd: str, arm_titles: dict[str, str]) -> str | None:
    if not is_ray_process(cmd):
        return None
    title = cmd.split()[0] if cmd.startswith("ray::") else ""
    return next((f"arm:{arm}" for arm, key in arm_titles.items() if key and key in title), "ray")


@dataclass
class CpuSnapshot:
    wall_s: float
    machine_busy_s: float  # every core's non-idle time
    by_group: dict[str, float] = field(default_factory=dict)


def _proc_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def snapshot(arm_titles: dict[str, str] | None = None, peer_pid: int | None = None) -> CpuSnapshot:
    """CPU seconds used so far by each group. `arm_titles`: arm -> a string its Ray processes' titles hold;
    `peer_pid`: a process whose whole tree counts as "peer". Processes that end between two snapshots
    take their seconds with them (the groups' deltas are then a lower bound; "other" absorbs it)."""
    arm_titles = arm_titles or {}
    cpu = psutil.cpu_times()
    busy = sum(cpu) - cpu.idle - getattr(cpu, "iowait", 0.0)
    snap = CpuSnapshot(time.monotonic(), busy)
    me = psutil.Process()
    peer: set[int] = set()
    if peer_pid:
        try:
            root = psutil.Process(peer_pid)
            peer = {root.pid} | {c.pid for c in root.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid == me.pid:
                group: str | None = "load generator"
            elif proc.pid in peer:
                group = "peer"
            else:
                group = _group_of(" ".join(proc.info["cmdline"] or []), arm_titles)
            if group is not None:
                snap.by_group[group] = snap.by_group.get(group, 0.0) + _proc_cpu_s(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return snap


def cores_used(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """Average cores each group kept busy between the snapshots (1.0 = one core all the time), "other" for
    the rest of the machine, and "machine" for all of it; groups under 0.001 cores are left out."""
    wall = max(after.wall_s - before.wall_s, 1e-9)
    used = {g: (s - before.by_group.get(g, 0.0)) / wall for g, s in after.by_group.items()}
    used = {g: max(v, 0.0) for g, v in used.items()}
    machine = max(after.machine_busy_s - before.machine_busy_s, 0.0) / wall
    used["other"] = max(machine - sum(used.values()), 0.0)
    used["machine"] = machine
    return {g: round(v, 3) for g, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.001}


def measure(fn: Callable[[], object], arm_titles: dict[str, str] | None = None,
            peer_pid: int | None = None) -> tuple[object, dict[str, float]]:
    """Run `fn` and return its result with the cores each group used meanwhile."""
    before = snapshot(arm_titles, peer_pid)
    out = fn()
    return out, cores_used(before, snapshot(arm_titles, peer_pid))
