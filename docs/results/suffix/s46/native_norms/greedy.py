"""Session 46: greedy target-only outputs of 18 eval prompts, as JSON to argv[1]; run from the repo root at two
commits (fa87e80 and its parent), then compared token by token."""

import json
import sys

import torch
from transformers import AutoTokenizer

from dspark.config.engine import EngineConfig
from dspark.models.target.loader import resolve_target_path
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
prompts = []
for name in ("gsm8k", "humaneval", "mt-bench"):
    rows = [json.loads(lv) for lv in open(f"../shared/data/eval/{name}.jsonl")][:6]
    for r in rows:
        text = r.get("question") or r.get("prompt") or (r.get("turns") or [""])[0]
        prompts.append(
            tok(
                tok.apply_chat_template(
                    [{"role": "user", "content": str(text)}], add_generation_prompt=True, tokenize=False
                )
            )["input_ids"]
        )
cfg = EngineConfig(
    dtype="bf16",
    drafter="none",
    scheduler="greedy",
    num_draft_tokens=0,
    max_num_seqs=1,
    max_model_len=1024,
    num_threads=2,
)
eng = Engine(cfg)
reqs = eng.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0))
json.dump(
    [r.output_ids if hasattr(r, "output_ids") else r.token_ids[len(p) :] for r, p in zip(reqs, prompts)],
    open(sys.argv[1], "w"),
)
