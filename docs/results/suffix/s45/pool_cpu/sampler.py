"""Per-thread CPU seconds of every process, every N s, to a JSONL file (for a later diff by stretch)."""
import json, sys, time, os
import psutil
out = open(sys.argv[1], "a")
period = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
while True:
    rec = {"t": time.time(), "procs": []}
    for p in psutil.process_iter(["cmdline", "pid"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])[:120]
            ths = []
            for th in p.threads():
                try:
                    comm = open(f"/proc/{p.pid}/task/{th.id}/comm").read().strip()
                except OSError:
                    comm = "?"
                ths.append([th.id, comm, round(th.user_time + th.system_time, 3)])
            rec["procs"].append([p.pid, cmd, ths])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    out.write(json.dumps(rec) + "\n"); out.flush()
    time.sleep(period)
