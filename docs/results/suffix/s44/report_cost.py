"""What a verify worker's per-step report to the SchedulerActor costs: a process runs a 4-5 ms stand-in step (30 bf16
matmuls, 2 threads) and after each step reports its load (the real SchedulerActor, the real WorkerLoad with a survival
table of `rows` requests), as VerifyWorker._after_step does; against the same steps without reports, interleaved."""
import json
import statistics
import sys
import time

import ray
import torch

from dspark.actors.cluster_scheduler import WorkerLoad
from dspark.actors.scheduler_actor import SchedulerClient, get_or_create_scheduler

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 32
every_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
get_or_create_scheduler("bench-scheduler", "dspark")
client = SchedulerClient("bench-scheduler", "dspark")
torch.set_num_threads(2)
a = torch.randn(rows, 576, dtype=torch.bfloat16)
w = [torch.randn(576, 1536, dtype=torch.bfloat16) for _ in range(30)]
def step():
    x = a
    for m in w:
        y = x @ m
        x = y[:, :576].contiguous()
    return x
def run(report: bool, seconds: float = 6.0) -> dict:
    n, t0, _c0, last = 0, time.perf_counter(), time.process_time(), 0.0
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
        if report:
            client.poll()
            if client.is_due and time.perf_counter() - last >= every_s:
                last = time.perf_counter()
                client.report(WorkerLoad("w0", rows, 0, 64, n, 20.0, rows * 2.0, [[0.8, 0.6, 0.4]] * rows, None, None))
    el = time.perf_counter() - t0
    return {"steps_per_s": n / el, "ms_per_step": 1e3 * el / n, "answers": client.num_answers}
for _ in range(2):
    step()
res = {"off": [], "on": []}
for _i in range(4):
    for k in ("off", "on"):
        res[k].append(run(k == "on"))
print(json.dumps({"rows": rows, "every_s": every_s, "ms_per_step_off": [round(r["ms_per_step"], 2) for r in res["off"]],
                  "ms_per_step_on": [round(r["ms_per_step"], 2) for r in res["on"]],
                  "median_ratio_on_off": round(statistics.median(r["ms_per_step"] for r in res["on"]) /
                                              statistics.median(r["ms_per_step"] for r in res["off"]), 4),
                  "reports": res["on"][-1]["answers"]}))
