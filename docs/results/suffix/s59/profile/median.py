"""Session 59: the Zen 5 EPYC's shipped SPS profiles, per dtype the runs hold the element-wise median of `dspark profile
--num-threads 2` runs on this CPU (its dtype choice: the runs', all alike), written as `dspark profile` names them
(first run1-3: both dtypes, 5 rounds, the fp32 table shipped; then settled1-3: bf16, 21 rounds, each step timed after
an untimed one of its size, the bf16 table shipped).
    .venv/bin/python docs/results/suffix/s59/profile/median.py OUT_DIR RUN_DIR..."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

out_dir, runs = Path(sys.argv[1]), [Path(d) for d in sys.argv[2:]]
for name in sorted(p.name for p in runs[-1].glob("*.json")):
    tables = [json.loads(next(d.glob(f"*{name.rsplit('-instruct-', 1)[1]}")).read_text()) for d in runs]
    choices = {json.dumps(t["meta"]["dtypes"]["choice"], sort_keys=True) for t in tables}
    assert len(choices) == 1, f"the runs chose differently: {choices}"
    assert all(t["tokens_per_step"] == tables[-1]["tokens_per_step"] for t in tables)
    median = [statistics.median(ms) for ms in zip(*(t["step_time_ms"] for t in tables))]
    meta = dict(tables[-1]["meta"])  # the last run: the identity as this code records it (CPUID family and model)
    at = dict(zip(tables[-1]["tokens_per_step"], median))
    meta["verify_cost_ratio"] = {k: round(at[int(k) + 1] / at[1], 3) for k in meta["verify_cost_ratio"]}
    meta["note"] = (f"step_time_ms: the element-wise median of {len(tables)} `dspark profile --num-threads 2` runs on "
                    f"this CPU ({', '.join(d.name for d in runs)}: {meta['num_repeats']} rounds each; "
                    "docs/results/suffix/s59/profile); dtypes: the last run's choice, every run's alike")
    out = {"tokens_per_step": tables[-1]["tokens_per_step"], "step_time_ms": median, "meta": meta}
    (out_dir / name).write_text(json.dumps(out, indent=2) + "\n")
    print(name, [round(x, 2) for x in median])
