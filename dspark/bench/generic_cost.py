"""`dspark bench generic`: what being generic costs. The same engine decodes the same prompts on targets of equal
size through the native flattened runner and through the generic transformers path (generic_runner.py):

- a Llama through both (`model_impl: transformers` forces the generic path): the cost on one model, outputs
  compared token for token;
- architectures no family describes (OLMo 2, Granite), which only the generic path serves, beside that Llama;
- optionally a real target (`extra_targets`, e.g. the shipped SmolLM2) through both paths.

Target-only and with n-gram speculation (variable verification lengths, rejected tokens rolled back), greedy,
EOS ignored, one warm-up per arm; arms interleaved round-robin over the repeats so that noise from a shared
host lands on every arm alike; medians and ratios from one run."""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dspark.bench.tiny_targets import make_family_dir
from dspark.config.engine import EngineConfig
from dspark.kernels.machine import cpu_signature
from dspark.models.target.generic_runner import GenericRunner
from dspark.models.target.loader import TargetModel, load_target
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams


@dataclass
class Arm:
    """One target through one path with one drafter."""

    name: str
    target: TargetModel
    model_impl: str  # auto | transformers (EngineConfig.model_impl)
    drafter: str  # none | ngram


def _prompts(vocab_size: int, num_requests: int, prompt_len: int) -> list[list[int]]:
    """Half of them repetitive (n-gram drafts get accepted), the rest a plain walk over the vocabulary."""
    prompts = []
    for i in range(num_requests):
        base = [(17 * i + 5 * j) % (vocab_size - 10) + 10 for j in range(3 if i % 2 == 0 else prompt_len)]
        prompts.append((base * prompt_len)[:prompt_len])
    return prompts


def _engine(arm: Arm, num_requests: int, max_model_len: int) -> Engine:
    cfg = EngineConfig(target=str(arm.target.path), drafter=arm.drafter, scheduler="fixed", num_draft_tokens=4,
                       scheduler_kwargs={"k": 4}, max_num_seqs=num_requests, max_model_len=max_model_len,
                       prefix_cache_mb=0, model_impl=arm.model_impl)
    return Engine(cfg, target=arm.target)


def _timed(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    return time.perf_counter() - t0, [r.output_ids for r in reqs]


def run_generic_cost(tokenizer: str, families: tuple[str, ...] = ("olmo2", "granite"),
                     extra_targets: tuple[str, ...] = (), num_requests: int = 8, prompt_len: int = 24,
                     max_tokens: int = 32, num_repeats: int = 3, hidden_size: int = 64,
                     num_layers: int = 2) -> dict:
    """Tokens per second of every arm (median over `num_repeats`), and the generic / native ratios."""
    with tempfile.TemporaryDirectory(prefix="dspark-generic-") as tmp:
        tiny = {kind: load_target(str(make_family_dir(kind, Path(tmp) / kind, tokenizer, hidden_size=hidden_size,
                                                      num_layers=num_layers)))
                for kind in ("llama", *families)}
        targets = {**{f"tiny_{k}": t for k, t in tiny.items()}, **{Path(t).name: load_target(t) for t in extra_targets}}
        arms = [Arm(f"{name}/{impl}/{drafter}", target, impl, drafter)
                for name, target in targets.items() for drafter in ("none", "ngram")
                for impl in ("auto", "transformers")
                if impl == "auto" or name == "tiny_llama" or name in {Path(t).name for t in extra_targets}]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engines, prompts, outputs = {}, {}, {}
        samples: dict[str, list[float]] = {arm.name: [] for arm in arms}
        for arm in arms:  # build and warm up every arm (first calls of each shape) before any timing
            engines[arm.name] = _engine(arm, num_requests, prompt_len + max_tokens + 8)
            prompts[arm.name] = _prompts(arm.target.model.config.vocab_size, num_requests, prompt_len)
            engines[arm.name].generate(prompts[arm.name], params)
        for _ in range(num_repeats):
            for arm in arms:
                wall_s, outputs[arm.name] = _timed(engines[arm.name], prompts[arm.name], params)
                samples[arm.name].append(num_requests * max_tokens / wall_s)
        rows = {}
        for arm in arms:
            runner = engines[arm.name].runner
            rows[arm.name] = {"architecture": arm.target.model.config.architectures[0],
                              "path": "generic" if isinstance(runner, GenericRunner) else "native",
                              "drafter": arm.drafter,
                              "num_parameters": sum(p.numel() for p in arm.target.model.parameters()),
                              "tok_s": round(statistics.median(samples[arm.name]), 1),
                              "tok_s_samples": [round(s, 1) for s in samples[arm.name]]}
    ratios, identical = {}, {}
    for name in targets:
        for drafter in ("none", "ngram"):
            native, generic = f"{name}/auto/{drafter}", f"{name}/transformers/{drafter}"
            if generic in rows:  # one model through both paths
                ratios[f"{name}/{drafter}: generic / native tok/s"] = round(
                    rows[generic]["tok_s"] / rows[native]["tok_s"], 3)
                identical[f"{name}/{drafter}"] = outputs[generic] == outputs[native]
            elif name != "tiny_llama" and name.startswith("tiny_"):  # generic-only, beside the native Llama
                ratios[f"{name} (generic only) / tiny_llama (native), {drafter}"] = round(
                    rows[native]["tok_s"] / rows[f"tiny_llama/auto/{drafter}"]["tok_s"], 3)
    return {"hardware": cpu_signature(), "num_requests": num_requests, "prompt_len": prompt_len,
            "max_tokens": max_tokens, "num_repeats": num_repeats, "tiny": {"hidden_size": hidden_size,
                                                                            "num_layers": num_layers,
                                                                            "tokenizer": tokenizer},
            "arms": rows, "ratios": ratios, "outputs_identical": identical}
