"""`dspark bench generate`: the offline generation path against the synth stage as it was, in one run.

- before: what the `synth` stage ran until now: the engine at 32 sequences, fp32, every matmul as
  W @ xᵀ (the runner's one kernel before `gemm_plan`), and target-only steps sampled by the general
  verifier (softmax of every (R, V) row, a full sort for top-p, V exponentials per request);
- after: the generation path: 256 continuously refilled sequences, the dtype measured fastest for
  generation, the kernels measured per row count, and plain steps sampled by `spec/nucleus.py`.
Both generate responses to the same prompts at T = 0.7, top-p 0.9. The "before" arm runs PyTorch ops
only (no native kernels, no prefix cache) but keeps the attention and KV-cache changes of the session
that built this path (they cannot be switched off), so the ratio understates the gain over the old code.
A chi-square check on real target logits compares the two samplers' laws.
"""

from __future__ import annotations

import time

import torch

from dspark.config.engine import EngineConfig, resolve_dtype
from dspark.kernels import native
from dspark.kernels.gemm_plan import GemmPlan
from dspark.kernels.machine import cpu_signature
from dspark.models.target.loader import load_target
from dspark.prompts.eval_sets import chat_prompt_ids
from dspark.prompts.seeds import man_page_prompts, stdlib_code_prompts
from dspark.spec.chi2 import chi_square_pvalue
from dspark.spec.nucleus import sample_nucleus
from dspark.spec.sampling import exponential_noise, logits_to_probs, sample_from_probs
from dspark.spec.verification import verify
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import Request, SamplingParams
from dspark.verify_service.step.batch import build_verify_input


class VerifierSampledEngine(Engine):
    """The engine as the synth stage used it: plain steps sampled by the general verifier."""

    def _sample_plain(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        return verify(build_verify_input(logits, reqs, [[] for _ in reqs], None, [0] * len(reqs))).next_token


def _prompts(tokenizer, num: int) -> list[list[int]]:
    texts = stdlib_code_prompts(num // 2, seed=1) + man_page_prompts(num - num // 2, seed=1)
    return [chat_prompt_ids(tokenizer, t) for t in texts[:num]]


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    reqs = engine.generate_bulk(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"num_prompts": len(prompts), "new_tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 1), "max_num_seqs": engine.config.max_num_seqs,
            "dtype": str(engine.target.dtype).removeprefix("torch.")}


def run_generate_bench(target_name: str, num_prompts_before: int = 64, num_prompts_after: int = 512,
                       max_tokens: int = 128) -> dict:
    base = dict(target=target_name, drafter="none", scheduler="fixed", draft_gate=False, num_draft_tokens=0)
    before_engine = VerifierSampledEngine(
        EngineConfig(**base, dtype="fp32", max_num_seqs=32, max_model_len=1024, prefix_cache_mb=0),
        target=load_target(target_name, "cpu", "fp32"))
    before_engine.runner.gemm_plan = GemmPlan.fixed("wx")
    before_engine.runner.fused, before_engine.runner.native_attention = None, False  # PyTorch ops only
    prompts = _prompts(before_engine.tokenizer, max(num_prompts_before, num_prompts_after))
    after_cfg = EngineConfig(**base, dtype="auto", dtype_role="generate", max_num_seqs=256, max_model_len=512)
    after_engine = Engine(after_cfg, target=load_target(target_name, "cpu", resolve_dtype(after_cfg)))
    _run(before_engine, prompts[:4], 8)  # warm-up both
    _run(after_engine, prompts[:4], 8)
    before = _run(before_engine, prompts[:num_prompts_before], max_tokens)
    after = _run(after_engine, prompts[:num_prompts_after], max_tokens)
    return {"cpu": cpu_signature(), "num_threads": torch.get_num_threads(), "max_tokens": max_tokens,
            "before": before, "after": after, "speedup": round(after["tok_s"] / before["tok_s"], 2),
            "sampler_check": sampler_check(before_engine, prompts[0], after_engine.target.dtype)}


def sampler_check(engine: Engine, prompt: list[int], dtype: torch.dtype, num_samples: int = 20_000) -> dict:
    """Sample one real next-token distribution (T 0.7, top-p 0.9) with both samplers; chi-square of
    the nucleus counts against the engine sampler's filtered probabilities. The logits are rounded to
    the generation path's dtype and sampled as it samples them (contiguous rows: the native pass where the
    kernels are available)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = engine.target.model.generate(ids, max_new_tokens=48, do_sample=False)
        rows = engine.target.model(out).logits[0, len(prompt):].to(dtype).float()  # (48, V) along a response
    all_probs = logits_to_probs(rows, torch.full((len(rows),), 0.7), torch.full((len(rows),), 0.9))
    sizes = (all_probs > 0).sum(dim=-1)
    pick = int(torch.where(sizes <= 200, sizes, 0).argmax())  # the widest nucleus a chi-square can cover
    logits, probs = rows[pick:pick + 1], all_probs[pick:pick + 1]
    gens = [torch.Generator().manual_seed(i) for i in range(num_samples)]
    ours = []
    for lo in range(0, num_samples, 1000):
        n = min(1000, num_samples - lo)
        ours += sample_nucleus(logits.to(dtype).repeat(n, 1), [0.7] * n, [0.9] * n, gens[lo:lo + n])
    gen = torch.Generator().manual_seed(1)
    theirs = [int(sample_from_probs(probs, exponential_noise(probs.shape, gen, None))[0])
              for _ in range(num_samples)]
    vocab = logits.shape[1]
    ours_c = torch.bincount(torch.tensor(ours), minlength=vocab)
    theirs_c = torch.bincount(torch.tensor(theirs), minlength=vocab)
    return {"num_samples": num_samples, "dtype": str(dtype).removeprefix("torch."),
            "native_pass": native.is_available(), "nucleus_size": int((probs[0] > 0).sum()),
            "p_value_nucleus_vs_probs": chi_square_pvalue(ours_c, probs[0]),
            "p_value_engine_sampler_vs_probs": chi_square_pvalue(theirs_c, probs[0]),
            "outside_nucleus": int(ours_c[probs[0] == 0].sum())}
