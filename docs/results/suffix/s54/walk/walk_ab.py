"""Session 54: the suffix sources' walk parameters (`WalkParams`, checkpoints/suffix-smollm2/config.json "walk") side by
side in one process. Target-only and hybrid engines differing only in the walk keys each arm overrides, run as
`s53/sps/sps_ab.py` runs its arms: batch 1, NUM mixed prompts, the arms in turn on each prompt (`run_interleaved`),
ROUNDS rounds; batch B > 1: WAVES x B prompts through B slots, arm by arm in turn (`run_refilled_in_turn`). Greedy,
128 tokens; outputs checked against target-only's. One JSON line.
ARMS: NAME=KEY:VALUE[,KEY:VALUE];... (a NAME alone: the shipped walk).
    .venv/bin/python docs/results/suffix/s54/walk/walk_ab.py BATCH,... ROUNDS ARMS > out.json
walk_ab_path_prob.json: `walk_ab.py 1,4,8 2 "p0.1=min_path_prob:0.1;p0.03=min_path_prob:0.03;p0.01=min_path_prob:0.01"`
(a walk stops once its path probability, the product of its continuations' frequencies, falls below
min_path_prob: 0.1 since the issue's first measurement, never tuned before)."""

from __future__ import annotations

import json
import sys

from dspark.bench.decode import BASE, _engine, arms_vs_target, mixed_frame, run_at
from dspark.config.engine import EngineConfig
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.hybrid import HybridDrafter
from dspark.models.drafters.suffix.drafter import DEFAULT_SUFFIX_DIR
from dspark.verify_service.engine import Engine

batches = [int(b) for b in sys.argv[1].split(",")]
rounds = int(sys.argv[2])
arms: dict[str, dict[str, float | int]] = {}
for spec in sys.argv[3].split(";"):
    name, _, keys = spec.partition("=")
    arms[name] = {k: float(v) if "." in v else int(v) for k, v in (kv.split(":") for kv in keys.split(",") if kv)}
waves, max_new, num_b1 = 4, 128, 24
target, labelled, max_len = mixed_frame(max(num_b1, max(batches) * waves), max_new)
max_len += 8
prompts = [p for _, p in labelled]
walk = json.loads((DEFAULT_SUFFIX_DIR / "config.json").read_text())["walk"]


def hybrid(bs: int, overrides: dict[str, float | int]) -> Engine:
    cfg = EngineConfig(target=target.name, drafter="hybrid", scheduler="greedy", num_draft_tokens=7,
                       max_num_seqs=bs, max_model_len=max_len, draft_gate=True)
    return Engine(cfg, target=target, drafter=HybridDrafter.build(target, walk={**walk, **overrides}))


result: dict = {"cpu": cpu_signature(), "rounds": rounds, "waves": waves, "arms": arms, "by_batch": {}}
for bs in batches:
    engines = {BASE: _engine(BASE, target, bs, max_len, "greedy", 7, None, True, {})}
    engines.update({name: hybrid(bs, overrides) for name, overrides in arms.items()})
    res = arms_vs_target(*run_at(engines, prompts, bs, max_new, rounds, num_b1, waves), labelled)
    result["by_batch"][bs] = res
    print(json.dumps({bs: res}), file=sys.stderr, flush=True)
print(json.dumps(result))
