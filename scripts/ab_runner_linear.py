"""A/B of the runner's matmul layout, interleaved in one process on the embedded default target.

`old`: (W @ xᵀ)ᵀ on whatever layout x arrives in (the runner before commit a3f579b: column-major
inputs after the first layer, any row count). `new`: `dspark.models.target.runner._linear` (row-major x,
rows padded to a multiple of 8 past 8). Prints, as JSON on its last line, the median forward time of
verify-shaped steps (requests × tokens over 256 cached tokens) and target-only decode tok/s at batch 8.

    .venv/bin/python scripts/ab_runner_linear.py [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import dspark.models.target.runner as runner_module
from dspark.config.engine import EngineConfig
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import load_target
from dspark.models.target.runner import TargetRunner
from dspark.prompts.eval_sets import chat_prompt_ids, load_turns
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

SHAPES = {"1x1": [1], "1x2": [2], "1x4": [4], "1x8": [8], "8x1": [1] * 8, "7x1+1x8": [1] * 7 + [8],
          "8x2": [2] * 8, "12x1": [1] * 12, "16x1": [1] * 16}
EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def old_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.mm(weight, x.t()).t()
    return out + bias if bias is not None else out


VARIANTS = {"old": old_linear, "new": runner_module._linear}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--decode-reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_target()
    runner = TargetRunner(target.model, 16, 600)
    slots = [runner.cache.allocate() for _ in range(16)]
    ctx = torch.randint(0, runner.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])
    times: dict[str, dict[str, list[float]]] = {v: {s: [] for s in SHAPES} for v in VARIANTS}
    for _ in range(args.reps):
        for shape, lens in SHAPES.items():
            chunks = [SeqChunk(slots[i], 256, ctx[:n], n) for i, n in enumerate(lens)]
            for name, fn in VARIANTS.items():  # interleaved, so drift on a shared machine hits both
                runner_module._linear = fn
                t0 = time.perf_counter()
                runner.forward(chunks)
                times[name][shape].append((time.perf_counter() - t0) * 1e3)
    prompts = [chat_prompt_ids(target.tokenizer, t) for f in sorted(EVAL_DIR.glob("*.jsonl"))
               for t in load_turns(f, 2)][:8]
    engine = Engine(EngineConfig(target=target.name, drafter="none", scheduler="fixed", max_num_seqs=8,
                                 max_model_len=2048), target=target)
    decode: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.decode_reps):
        for name, fn in VARIANTS.items():
            runner_module._linear = fn
            t0 = time.perf_counter()
            reqs = engine.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
            decode[name].append(sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - t0))
    runner_module._linear = VARIANTS["new"]
    print(json.dumps({
        "forward_ms_median": {v: {s: round(statistics.median(x), 1) for s, x in t.items()} for v, t in times.items()},
        "forward_ms_min": {v: {s: round(min(x), 1) for s, x in t.items()} for v, t in times.items()},
        "decode_batch8_tok_s_median": {v: round(statistics.median(x), 1) for v, x in decode.items()},
        "reps": args.reps, "decode_reps": args.decode_reps, "num_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
