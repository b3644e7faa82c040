"""Cores by process between consecutive samples of sampler.py, averaged over the windows in which the machine was
busy (> 1.8 cores), grouped by the busiest process of the window (the arm whose turn it was).
Session 45: `python analyze3.py samples.jsonl > cores_by_process.txt` (samples.jsonl.gz here)."""

import collections
import json
import sys

ROLES = ("haproxy", "raylet", "gcs_server", "dashboard", "bin/dspark", "sampler", "log_monitor", "runtime_env",
         "process_api", "monitor.py")


def role(cmd: str) -> str:
    first = cmd.split()[0] if cmd else "?"
    if first.startswith("ray::"):
        return first.split(".")[0][:55]
    return next((k for k in ROLES if k in cmd), "other:" + cmd[:30])


def main() -> None:
    records = [json.loads(line) for line in open(sys.argv[1])]  # noqa: SIM115
    prev = None
    groups: dict[str, list[collections.Counter]] = collections.defaultdict(list)
    for rec in records:
        cur = {(pid, tid): t for pid, _, threads in rec["procs"] for tid, _, t in threads}
        roles = {pid: role(cmd) for pid, cmd, _ in rec["procs"]}
        if prev is not None:
            dt = rec["t"] - prev[0]
            cores: collections.Counter = collections.Counter()
            for key, t in cur.items():
                if key in prev[1]:
                    cores[roles[key[0]]] += (t - prev[1][key]) / dt
            if sum(cores.values()) > 1.8:
                groups[cores.most_common(1)[0][0]].append(cores)
        prev = (rec["t"], cur)
    labels = list(groups)
    print(f"{'process':56s}" + "".join(f"{lab[-22:]:>24s}" for lab in labels))
    names = sorted({k for windows in groups.values() for w in windows for k in w})
    rows = []
    for name in names:
        vals = [sum(w.get(name, 0) for w in groups[lab]) / len(groups[lab]) for lab in labels]
        rows.append((max(vals), name, vals))
    for _, name, vals in sorted(rows, reverse=True)[:20]:
        print(f"{name:56s}" + "".join(f"{v:24.3f}" for v in vals))
    print("windows", [len(groups[lab]) for lab in labels])


if __name__ == "__main__":
    main()
