#!/bin/bash
# the shipped app (serve.yaml) idle: CPU per process over 60 s once it answers
cd /work/main
env $(.venv/bin/python -m dspark.cluster.ingress.front_door) .venv/bin/serve run configs/serve.yaml > /tmp/s43/idle_serve.log 2>&1 &
SP=$!
for i in $(seq 1 300); do curl -s -o /dev/null -w "%{http_code}" localhost:8000/v1/models 2>/dev/null | grep -q 200 && break; sleep 2; done
echo ready after $((i*2)) s
sleep 30
.venv/bin/python - <<'PY'
import psutil, time, json, collections
def snap():
    out = {}
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            t = p.cpu_times(); out[p.pid] = (" ".join(p.info["cmdline"] or [p.info["name"]])[:70], t.user + t.system)
        except Exception: pass
    return out
a = snap(); time.sleep(60); b = snap()
use = collections.Counter()
for pid, (name, t) in b.items():
    if pid in a: use[name] += (t - a[pid][1]) / 60
tot = sum(use.values())
print(json.dumps({"total_cores": round(tot, 3), "top": [(n, round(v, 4)) for n, v in use.most_common(25)]}, ))
PY
kill -INT $SP; sleep 15; .venv/bin/serve shutdown -y >/dev/null 2>&1; .venv/bin/ray stop --force >/dev/null 2>&1
