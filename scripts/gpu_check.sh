#!/usr/bin/env bash
# GPU check (issues 30 and 28). On a CUDA machine, for each tiny family of tests/families.py: greedy output of
# the engine (target-only, n-gram) equals transformers' generate on the GPU, and the runner's logits match HF's;
# then the hybrid drafter (suffix sources + a random DSpark) on the tiny Llama, colocated and decoupled (a gloo
# pair, the draft pools' data path): greedy output equals generate, and at T = 1 the tokens follow the target's
# distribution (chi-square of the PIT, 3 positions at alpha 1e-4). Session 36 ran the families and greedy parts
# on an H200 (docs/results/families/gpu_check_h200_s36.json); the T = 1 part was written after the GPU was gone
# and checked on CPU only (the script with "cuda" replaced: p-values 0.79 / 0.14 / 0.42 and 0.65 / 0.97 / 0.61). Prints one JSON object; at most ~8 minutes.
# Each part reports its own error instead of stopping the others.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
timeout 480 "$PY" - <<'PY'
import json, tempfile, time, traceback
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


def failure(e: BaseException) -> str:
    """A part's error, with the frames it came from (innermost first)."""
    frames = reversed(traceback.extract_tb(e.__traceback__)[-4:])
    return f"{type(e).__name__}: {e}"[:300] + " @ " + " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}"
                                                              for f in frames)


root = Path(tempfile.mkdtemp())
tok = make_tiny_target_dir(root / "tiny")
report = {"device": torch.cuda.get_device_name(0), "families": {}}
for kind in FAMILY_CONFIGS:
    t0 = time.perf_counter()
    try:
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
    except Exception as e:  # noqa: BLE001
        report["families"][kind] = {"error": failure(e)}

# the hybrid drafter on the GPU, both modes (tests/test_suffix_proposer.py's helpers, with the target on CUDA)
from tests.test_suffix_proposer import hybrid_engine, make_hybrid, self_distilled_docs, source_counts
from tests.test_engine_lossless import tiny_prompts
t0 = time.perf_counter()
report["hybrid"] = {}
try:
    target = load_target(str(tok), device="cuda", dtype="fp32")
    vocab = target.model.config.vocab_size
    prompts = tiny_prompts(vocab)[:16]
    refs = []
    for p in prompts:
        i = torch.tensor([p], device="cuda")
        refs.append(target.model.generate(i, attention_mask=torch.ones_like(i), do_sample=False, max_new_tokens=32,
                                          eos_token_id=[], pad_token_id=target.tokenizer.pad_token_id)[0, len(p):]
                    .tolist())
    docs = self_distilled_docs(target, tiny_prompts(vocab)[16:], 48, 0.0)
except Exception as e:  # noqa: BLE001
    report["hybrid"]["setup_error"] = failure(e)
    prompts = None
for mode in ("colocated", "decoupled") if prompts is not None else ():
    try:
        hybrid = make_hybrid(target, docs)
        cfg = EngineConfig(target=str(target.path), drafter="hybrid", scheduler="greedy", num_draft_tokens=7,
                           max_num_seqs=8, max_model_len=512, device="cuda", dtype="fp32",
                           sps_profile=tiny_sps_path(target.path), draft_gate=False)
        with hybrid_engine(mode, cfg, target, hybrid) as engine:
            reqs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        report["hybrid"][mode] = {"greedy_equals_hf": [r.output_ids for r in reqs] == refs,
                                  "accepted": sum(r.num_accepted for r in reqs), "sources": source_counts(engine)}
    except Exception as e:  # noqa: BLE001
        report["hybrid"][mode] = {"error": failure(e)}
# T = 1 with the hybrid on the GPU, both modes: tokens 2-4 of 3,000 requests of one prompt (drafts from the
# cheap sources' q and DSpark's samples, verified with min(1, p/q) and the residual) follow the target's own
# distribution: chi-square of the randomised PIT against uniform, as tests/test_suffix_proposer.py does on CPU
import numpy as np
from dspark.spec.chi2 import ALPHA, chi_square_pvalue
for mode in ("colocated", "decoupled") if prompts is not None else ():
    key = f"t1_{mode}"
    try:
        prompt = tiny_prompts(vocab)[1][:12]
        hybrid = make_hybrid(target, self_distilled_docs(target, [prompt] * 64, 6, 1.0))
        cfg = EngineConfig(target=str(target.path), drafter="hybrid", scheduler="fixed", scheduler_kwargs={"k": 3},
                           num_draft_tokens=4, max_num_seqs=64, max_model_len=64, prefix_cache_mb=0,
                           device="cuda", dtype="fp32")
        with hybrid_engine(mode, cfg, target, hybrid) as engine:
            reqs = engine.generate([prompt] * 3000, [SamplingParams(max_tokens=4, temperature=1.0, seed=10_000 + i,
                                                                    ignore_eos=True) for i in range(3000)])
        rng, pvalues = np.random.default_rng(0), []
        for pos in (1, 2, 3):
            counts = torch.zeros(20)
            prefixes = torch.tensor([prompt + r.output_ids[:pos] for r in reqs], device="cuda")
            with torch.inference_mode():
                probs = torch.softmax(target.model(prefixes).logits[:, -1].float(), -1).cpu()
            cdf = torch.cumsum(probs, -1) - probs
            for row, r in enumerate(reqs):
                tok = r.output_ids[pos]
                u = float(cdf[row, tok]) + rng.random() * float(probs[row, tok])
                counts[min(19, int(u * 20))] += 1
            pvalues.append(chi_square_pvalue(counts, torch.full((20,), 1 / 20)))
        report["hybrid"][key] = {"pvalues": [round(p, 4) for p in pvalues], "alpha": ALPHA,
                                 "passes": all(p > ALPHA for p in pvalues), "sources": source_counts(engine)}
    except Exception as e:  # noqa: BLE001
        report["hybrid"][key] = {"error": failure(e)}
report["hybrid"]["s"] = round(time.perf_counter() - t0, 1)
report["ok"] = (all("error" not in f and all(f["greedy_equals_hf"].values()) and f["max_logit_err"] < 1e-3
                    for f in report["families"].values())
                and all(report["hybrid"].get(m, {}).get("greedy_equals_hf") for m in ("colocated", "decoupled"))
                and all(report["hybrid"].get(f"t1_{m}", {}).get("passes") for m in ("colocated", "decoupled")))
print(json.dumps(report))
PY
