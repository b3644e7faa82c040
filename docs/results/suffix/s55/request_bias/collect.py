"""Session 55: does a request's own verdict history say more about its next drafts' survival than the calibrated
survival already does? Decodes held-out self-distilled prompts (never the eval sets) with the shipped suffix
drafter under a fixed k = 7 (every proposed position verified up to the first rejection: uncensored outcomes), and
logs per round: request, round index, source, the survival c_k the proposal carried, positions verified, accepted.
    .venv/bin/python docs/results/suffix/s55/request_bias/collect.py OUT.jsonl [NUM_PROMPTS] [TEMPERATURE]"""

from __future__ import annotations

import json
import sys

from dspark.config.engine import EngineConfig
from dspark.models.drafters.suffix.corpus import corpus_paths, read_heldout_prompts
from dspark.models.drafters.suffix.drafter import SuffixDrafter
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

out_path = sys.argv[1]
num_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 96
temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
# as `dspark suffix calibrate`: the held-out prompts' responses left out of the index
drafter = SuffixDrafter.from_pretrained(heldout_fraction=0.06)
engine = Engine(EngineConfig(target="smollm2-135m-instruct", drafter="custom", scheduler="fixed",
                             scheduler_kwargs={"k": 7}, num_draft_tokens=7, max_num_seqs=16, max_model_len=2048,
                             dtype="bf16"), drafter=drafter)
records = read_heldout_prompts(corpus_paths(drafter.config.corpus_dirs), drafter.config.heldout_fraction,
                               num_prompts)
prompts = [r["prompt_ids"] for r in records if len(r["prompt_ids"]) + 140 <= 2048]
log: list[dict] = []
feedback = drafter.feedback


def logged(request_ids: list[str], num_verified: list[int], num_accepted: list[int]) -> None:
    for rid, v, a in zip(request_ids, num_verified, num_accepted):
        p = drafter.last.get(rid)
        if p is not None and v > 0:
            log.append({"rid": rid, "source": p.source, "c": [round(x, 5) for x in p.conditional], "v": v, "a": a})
    feedback(request_ids, num_verified, num_accepted)


drafter.feedback = logged  # type: ignore[method-assign]
engine.generate(prompts, SamplingParams(max_tokens=128, temperature=temperature, ignore_eos=True))
with open(out_path, "w") as f:
    for row in log:
        f.write(json.dumps(row) + "\n")
print(json.dumps({"prompts": len(prompts), "rounds": len(log)}))
