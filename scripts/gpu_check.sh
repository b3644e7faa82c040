#!/usr/bin/env bash
# GPU check for issue 30 (untested here: no GPU was lent to the task that wrote it). On a CUDA machine, for each
# tiny family of tests/families.py: greedy output of the engine (target-only, n-gram) equals transformers'
# generate on the GPU, and the runner's logits match HF's. Prints one JSON object; at most ~8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
timeout 480 "$PY" - <<'PY'
import json, tempfile, time
from pathlib import Path
import torch
from dspark.models.target.layer import SeqChunk
from dspark.models.target.runner import TargetRunner
from dspark.models.target.loader import load_target
from dspark.config.engine import EngineConfig
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams
from tests.families import FAMILY_CONFIGS, make_family_dir
from tests.tiny import make_tiny_target_dir, tiny_sps_path

assert torch.cuda.is_available(), "no CUDA device"
root = Path(tempfile.mkdtemp())
tok = make_tiny_target_dir(root / "tiny")
report = {"device": torch.cuda.get_device_name(0), "families": {}}
for kind in FAMILY_CONFIGS:
    t0 = time.perf_counter()
    target = load_target(str(make_family_dir(kind, root / kind, tok)), device="cuda", dtype="fp32")
    runner = TargetRunner(target.model, 1, 64)
    seq = torch.randint(4, runner.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    out = runner.forward([SeqChunk(runner.cache.allocate(), 0, seq.tolist(), 24)])
    with torch.no_grad():
        ref = target.model(seq[None].cuda()).logits[0]
    prompts = [(list(range(5, 9)) * 6)[:n] for n in (12, 17, 21)]
    ids = [torch.tensor([p], device="cuda") for p in prompts]
    refs = [target.model.generate(i, attention_mask=torch.ones_like(i), do_sample=False, max_new_tokens=12,
                                  eos_token_id=[], pad_token_id=target.tokenizer.pad_token_id)[0, len(p):].tolist()
            for i, p in zip(ids, prompts)]
    equal = {}
    for drafter in ("none", "ngram"):
        cfg = EngineConfig(target=str(target.path), drafter=drafter, device="cuda", dtype="fp32", max_num_seqs=2,
                           max_model_len=128, sps_profile=tiny_sps_path(target.path))
        reqs = Engine(cfg, target=target).generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        equal[drafter] = [r.output_ids for r in reqs] == refs
    report["families"][kind] = {"runner": type(runner).__name__,
                                "max_logit_err": float((out.logits - ref).abs().max()),
                                "greedy_equals_hf": equal, "s": round(time.perf_counter() - t0, 1)}
report["ok"] = all(all(f["greedy_equals_hf"].values()) and f["max_logit_err"] < 1e-3
                   for f in report["families"].values())
print(json.dumps(report))
PY
