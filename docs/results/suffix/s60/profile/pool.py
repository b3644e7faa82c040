"""Session 60: the Zen 5 EPYC's bf16 SPS profile as each size's median over eight `dspark profile --num-threads 2
--dtypes bf16 --num-repeats 21` runs measured with the same code (each step timed after an untimed one of its size):
session 59's three (`s59/profile/settled1-3`, the shipped table was their median) and session 60's five (`run1-5`),
by `profiles.median_of_runs`. Writes OUT (the table, named as `dspark profile` names it) and prints each size's median
and range.
    .venv/bin/python docs/results/suffix/s60/profile/pool.py OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.models.target.profiles import median_of_runs
from dspark.spec.sps import SPSTable

HERE = Path(__file__).resolve().parent
RUNS = [HERE.parents[1] / "s59" / "profile" / f"settled{i}" for i in (1, 2, 3)] + \
    [HERE / f"run{i}" for i in range(1, 6)]
NAME = "cpu-avx512-amd-epyc-f26m2-smollm2-135m-instruct-bfloat16-2t.json"
tables = [SPSTable.from_file(d / NAME) for d in RUNS]
pooled = median_of_runs(tables)
pooled.meta["note"] = ("step_time_ms: each size's median over 8 `dspark profile --num-threads 2 --dtypes bf16 "
                       "--num-repeats 21` runs on this CPU (docs/results/suffix/s59/profile/settled1-3, "
                       "docs/results/suffix/s60/profile/run1-5; docs/results/suffix/s60/profile/pool.py)")
pooled.meta["dtypes"] = tables[-1].meta["dtypes"]
out = Path(sys.argv[1]) / NAME
out.parent.mkdir(parents=True, exist_ok=True)
pooled.save(out)
print(json.dumps({"out": str(out), "ms": {n: round(t, 2) for n, t in zip(pooled.tokens_per_step, pooled.step_time_ms)},
                  "range_ms": pooled.meta["range_ms"], "verify_cost_ratio": pooled.meta["verify_cost_ratio"]}))
