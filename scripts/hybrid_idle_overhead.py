"""What drafting costs a decode step when nothing is verified: the engine at batch B with no drafter, with
prompt lookup, the suffix sources and the hybrid, the drafters under a fixed scheduler that verifies 0 tokens
(so every step is a plain target step plus the drafter's and scheduler's own work). One static batch (no
arrivals: no prefill mixed into the decode steps). Median decode-step time of the full
batch per repeat, arms interleaved; prints JSON.

    .venv/bin/python scripts/hybrid_idle_overhead.py --batch 16 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dspark.config.engine import EngineConfig
from dspark.models.target.loader import load_target
from dspark.prompts.eval_sets import mixed_prompts
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

ARMS = {"none": {"drafter": "none"},
        "ngram-k0": {"drafter": "ngram"},
        "suffix-k0": {"drafter": "suffix", "drafter_kwargs": {"sources": ["request", "corpus"]}},
        "hybrid-k0": {"drafter": "hybrid", "drafter_kwargs": {"sources": ["request", "corpus"]}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m-instruct", "cpu", "fp32")
    # the shared eval sets' prompts, round-robin over the domains (as `bench decode` takes them)
    prompts = [p for _, p in mixed_prompts(target.tokenizer, args.batch, max_prompt_tokens=300)]
    engines = {name: Engine(EngineConfig(target="smollm2-135m-instruct", dtype="fp32", scheduler="fixed",
                                         scheduler_kwargs={"k": 0}, max_num_seqs=args.batch, max_model_len=512,
                                         draft_gate=False, num_threads=args.threads, **kw), target=target)
               for name, kw in ARMS.items()}
    step_ms: dict[str, list[float]] = {name: [] for name in ARMS}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            engine.stats.clear()
            engine.generate(prompts, SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True))
            steps = [s for s in engine.stats if s.num_tokens == args.batch][5:]  # whole-batch decode steps
            step_ms[name].append(statistics.median((s.end_s - s.start_s) * 1e3 for s in steps))
    base = statistics.median(step_ms["none"])
    print(json.dumps({"batch": args.batch, "threads": args.threads, "step_ms": step_ms,
                      "ratio_to_none": {n: round(statistics.median(v) / base, 4) for n, v in step_ms.items()}}))


if __name__ == "__main__":
    main()
