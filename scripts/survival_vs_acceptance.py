"""Predicted prefix survival of the verified draft tokens against their acceptance, in process, under continuous
batching: does the survival the prefix scheduler reads promise what verification then accepts?

    .venv/bin/python scripts/survival_vs_acceptance.py [--batch 32] [--threads 1] [--drafter hybrid] > out.json

Every round of at least 3/4 of the batch: each verified draft token's a_k = Π c_i (the drafter's
confidences) against whether it was accepted, pooled by bands of a_k and by the source that drafted it.
"""

from __future__ import annotations

import argparse
import json

import torch

from dspark.bench.decode import _generate_refilled
from dspark.config.engine import EngineConfig
from dspark.models.target.loader import load_target
from dspark.prompts.eval_sets import mixed_prompts
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

BANDS = [(0.0, 0.2), (0.2, 0.3), (0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.01)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafter", default="hybrid")
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m-instruct", "cpu", args.dtype)
    prompts = [p for _, p in mixed_prompts(target.tokenizer, 2 * args.batch)]
    cfg = EngineConfig(target=target.name, drafter=args.drafter, scheduler="greedy", num_draft_tokens=7,
                       max_num_seqs=args.batch, max_model_len=2048, dtype=args.dtype)
    engine = Engine(cfg, target=target)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    engine.stats.clear()
    _generate_refilled(engine, prompts, SamplingParams(max_tokens=128, ignore_eos=True), args.batch)
    bands: dict[tuple[float, float], list[float]] = {b: [0, 0.0, 0] for b in BANDS}  # n, Σ predicted, accepted
    sources: dict[str, list[float]] = {}
    for step in engine.stats:
        if step.num_requests < 3 * args.batch // 4 or step.confidences is None:
            continue
        for r, (length, accepted) in enumerate(zip(step.lengths, step.num_accepted)):
            survival = 1.0
            for k in range(length):
                survival *= step.confidences[r][k]
                for cell in [bands[b] for b in BANDS if b[0] <= survival < b[1]] + \
                        [sources.setdefault((step.sources[r] if step.sources else "") or "?", [0, 0.0, 0])]:
                    cell[0] += 1
                    cell[1] += survival
                    cell[2] += accepted > k

    def row(c: list[float]) -> dict:
        return {"n": int(c[0]), "predicted": round(c[1] / c[0], 3), "accepted": round(c[2] / c[0], 3)}

    print(json.dumps({"batch": args.batch, "threads": args.threads, "drafter": args.drafter,
                      "by_band": {f"{lo:.1f}-{min(hi, 1.0):.1f}": row(c) for (lo, hi), c in bands.items() if c[0]},
                      "by_source": {s: row(c) for s, c in sources.items()}}, indent=1))


if __name__ == "__main__":
    main()
