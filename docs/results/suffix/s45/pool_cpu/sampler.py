"""Per-thread CPU seconds of every process, every N s, appended to a JSONL file (diffed by analyze3.py).
Session 45: `python sampler.py samples.jsonl 3` beside `dspark bench serve` (arms.yaml)."""

import json
import sys
import time

import psutil


def main() -> None:
    out = open(sys.argv[1], "a")  # noqa: SIM115 - open for the sampler's whole life
    period = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    while True:
        rec: dict = {"t": time.time(), "procs": []}
        for p in psutil.process_iter(["cmdline", "pid"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])[:120]
                threads = []
                for th in p.threads():
                    try:
                        comm = open(f"/proc/{p.pid}/task/{th.id}/comm").read().strip()  # noqa: SIM115
                    except OSError:
                        comm = "?"
                    threads.append([th.id, comm, round(th.user_time + th.system_time, 3)])
                rec["procs"].append([p.pid, cmd, threads])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        out.write(json.dumps(rec) + "\n")
        out.flush()
        time.sleep(period)


if __name__ == "__main__":
    main()
