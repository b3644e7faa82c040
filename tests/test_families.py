"""Every family the runner describes (family.py) and the generic path for the rest compute what transformers
computes: logits and hidden states of mixed chunks with rollback, greedy engine output token for token equal
to `generate` (target-only, n-gram, a tiny DSpark drafter; the windowed and MoE families with prompts longer
than the window), and sampled tokens that follow the target's T = 1 distribution."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.config.engine import EngineConfig
from dspark.kernels.gemm_plan import GemmPlan
from dspark.models.drafters.dspark.drafter import DSparkDrafter
from dspark.models.target.generic_runner import GenericRunner
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import TargetModel, load_target
from dspark.models.target.runner import TargetRunner
from dspark.spec.chi2 import ALPHA, chi_square_pvalue
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams
from tests.families import FAMILY_CONFIGS, GENERIC, NATIVE, WINDOW, make_family_dir
from tests.test_engine_lossless import hf_greedy
from tests.test_suffix_proposer import pit_counts
from tests.tiny import tiny_sps_path
from tests.tiny_drafters import make_dspark

NUM_PROMPTS = 6
NUM_NEW = 16
ENGINE_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_moe_window", "gemma3", "phi3", "llama3_rope", "olmo2")


@pytest.fixture(scope="module")
def family_targets(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TargetModel]:
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("families")
    return {kind: load_target(str(make_family_dir(kind, root / kind, tiny_target_dir))) for kind in FAMILY_CONFIGS}


def _prompts(vocab: int) -> list[list[int]]:
    """Longer than the sliding window (WINDOW); every other one repetitive, so n-gram drafts get accepted."""
    gen = torch.Generator().manual_seed(5)
    prompts = []
    for i in range(NUM_PROMPTS):
        n = int(torch.randint(WINDOW + 3, 3 * WINDOW, (1,), generator=gen))
        base = torch.randint(4, vocab, (n if i % 2 == 0 else 3,), generator=gen).tolist()
        prompts.append((base * n)[:n])
    return prompts


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_runner_matches_hf_forward_with_rollback(family_targets, kind):
    target = family_targets[kind]
    runner_type = GenericRunner if kind in GENERIC else TargetRunner
    for pytorch_only in (False, True):  # the native kernels where they apply, then the PyTorch ops alone
        runner = TargetRunner(target.model, 4, 64, gemm_plan=GemmPlan.fixed("linear") if pytorch_only else None)
        assert type(runner) is runner_type
        if pytorch_only and runner_type is TargetRunner:
            runner.fused, runner.native_attention = None, False
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(4, runner.vocab_size, (n,), generator=gen) for n in (20, 13, 1, 9)]
        slots = [runner.cache.allocate() for _ in seqs]
        cut = [17, 10, 1, 2]
        first = runner.forward([SeqChunk(s, 0, q[:c].tolist(), c) for s, q, c in zip(slots, seqs, cut)],
                               hidden_layers=(0, 1))
        runner.forward([SeqChunk(s, c, [5, 6, 7], 3) for s, c in zip(slots, cut)])  # drafts, all rejected
        second = runner.forward([SeqChunk(s, c, q[c:].tolist(), len(q) - c)
                                 for s, q, c in zip(slots, seqs, cut) if len(q) > c])
        with torch.no_grad():
            refs = [target.model(q[None], output_hidden_states=True) for q in seqs]
        for got, ref, c in zip(torch.split(first.logits, cut), refs, cut):
            torch.testing.assert_close(got, ref.logits[0, :c], atol=2e-5, rtol=2e-5)
        for layer in (0, 1):
            torch.testing.assert_close(first.hidden_states[layer],
                                       torch.cat([r.hidden_states[layer][0, :c] for r, c in zip(refs, cut)]),
                                       atol=2e-5, rtol=2e-5)
        rest = [(r, c, len(q) - c) for r, q, c in zip(refs, seqs, cut) if len(q) > c]
        for got, (ref, c, _) in zip(torch.split(second.logits, [n for *_, n in rest]), rest):
            torch.testing.assert_close(got, ref.logits[0, c:], atol=2e-5, rtol=2e-5)


def _engine(target: TargetModel, drafter: str, max_num_seqs: int = 3, **extra) -> Engine:
    cfg = EngineConfig(target=str(target.path), drafter="none" if drafter == "dspark" else drafter,
                       scheduler=extra.pop("scheduler", "greedy"), num_draft_tokens=5, max_num_seqs=max_num_seqs,
                       max_model_len=128, sps_profile=tiny_sps_path(target.path), **extra)
    dspark = DSparkDrafter(make_dspark(target), target) if drafter == "dspark" else None
    return Engine(cfg, target=target, drafter=dspark)


@pytest.mark.parametrize("drafter", ["none", "ngram", "dspark"])
@pytest.mark.parametrize("kind", ENGINE_FAMILIES)
def test_greedy_engine_equals_hf_generate(family_targets, kind, drafter):
    target = family_targets[kind]
    prompts = _prompts(target.model.config.vocab_size)
    refs = [hf_greedy(target, p, NUM_NEW) for p in prompts]
    engine = _engine(target, drafter)  # 6 prompts through 3 slots: requests join and leave
    reqs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    mismatches = [i for i, (r, ref) in enumerate(zip(reqs, refs)) if r.output_ids != ref]
    assert not mismatches, f"{kind}/{drafter}: prompts {mismatches} differ from HF generate"
    if drafter == "ngram":
        assert sum(r.num_accepted for r in reqs) > 0  # the drafts were really verified and used


@pytest.mark.parametrize("kind", ["gemma3", "olmo2"])
def test_sampled_tokens_follow_the_target_distribution(family_targets, kind):
    """T = 1, 1,200 requests of one prompt (longer than the window), 3 tokens each, a random DSpark drafter
    verified at fixed k = 2 (rejection sampling on every token after the first). Positions 2-3 by a chi-square
    on the PIT bins at ALPHA: a lossless engine fails with probability <= 2e-4 (fixed seeds: deterministic)."""
    target = family_targets[kind]
    prompt = _prompts(target.model.config.vocab_size)[1][:WINDOW + 4]
    engine = _engine(target, "dspark", max_num_seqs=64, scheduler="fixed", scheduler_kwargs={"k": 2},
                     prefix_cache_mb=0)
    num = 1200
    reqs = engine.generate([prompt] * num, [SamplingParams(max_tokens=3, temperature=1.0, seed=20_000 + i,
                                                           ignore_eos=True) for i in range(num)])
    assert sum(r.num_accepted for r in reqs) > 0
    rng = np.random.default_rng(0)
    for pos in (1, 2):
        pit = pit_counts(target, [prompt + r.output_ids[:pos] for r in reqs], [r.output_ids[pos] for r in reqs], rng)
        assert chi_square_pvalue(pit, torch.full((20,), 1 / 20)) > ALPHA, f"{kind} position {pos + 1}: {pit}"


def test_native_families_take_the_native_kernels_where_they_apply(family_targets):
    """The fused one-call stack for Llama-math families, native attention for the rest (windows by key rows),
    the PyTorch rotary only for a partial rotary."""
    runners = {k: TargetRunner(family_targets[k].model, 1, 64) for k in NATIVE}
    assert all(r.native_attention for k, r in runners.items() if k != "phi3_partial_rotary")
    assert not runners["phi3_partial_rotary"].native_attention
    assert [r.window for r in runners["gemma3"].layers] == [WINDOW, None]
    assert runners["qwen3_moe"].layers[0].moe is not None and runners["qwen3_moe"].layers[1].moe is None


def test_generic_path_speed_beside_the_native_path_on_llama(tiny_target: TargetModel):
    """The cost of being generic, measured on the tiny Llama (same output, both printed)."""
    prompts = [list(range(5, 5 + 12 + i)) for i in range(8)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    results = {}
    for path in ("native", "generic"):
        engine = _engine(tiny_target, "none", max_num_seqs=8, prefix_cache_mb=0,
                         model_impl="transformers" if path == "generic" else "auto")
        assert isinstance(engine.runner, GenericRunner) == (path == "generic")
        engine.generate(prompts, params)  # warm-up: first calls of each shape
        t0 = time.perf_counter()
        reqs = engine.generate(prompts, params)
        results[path] = (time.perf_counter() - t0, [r.output_ids for r in reqs])
    assert results["native"][1] == results["generic"][1]
    num_tokens = len(prompts) * params.max_tokens
    print(f"\ntiny Llama, 8 requests x 32 tokens, target-only: native {num_tokens / results['native'][0]:.0f} tok/s, "
          f"generic {num_tokens / results['generic'][0]:.0f} tok/s "
          f"({results['generic'][0] / results['native'][0]:.1f}x the time)")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "gemma3", "phi3", "olmo2"])
def test_drafters_built_from_each_family_load_only_against_their_target(family_targets, kind, tmp_path):
    """DSpark / DFlash / EAGLE-3 / MTP-1 built from the target's config (sizes, tapped layers, vocab, signature),
    started from its layers, saved and loaded by name; against another target the load is refused with why."""
    from dspark.models.drafters.ar.eagle3 import Eagle3Model
    from dspark.models.drafters.ar.eagle3_config import Eagle3Config
    from dspark.models.drafters.dspark.config import DSparkConfig, default_target_layers
    from dspark.models.drafters.dspark.model import DSparkModel
    from dspark.models.drafters.registry import make_drafter
    from tests.tiny_drafters import NUM_DRAFT_VOCAB, draft_vocab, save_tiny_baseline

    target, other = family_targets[kind], family_targets["qwen3" if kind != "qwen3" else "phi3"]
    cfg = DSparkConfig.from_target(target.model.config, NUM_DRAFT_VOCAB, num_layers=1)
    assert cfg.target["architecture"] == target.model.config.architectures[0]
    assert cfg.target_layers == [1, 2] and cfg.target_hidden_size == 64
    model = DSparkModel(cfg, draft_vocab(target.model.config.vocab_size))
    if kind in GENERIC:  # no description to copy layers by: said so, the drafter trains from random weights
        with pytest.raises(ValueError, match="needs a family description"):
            model.init_from_target(target.model)
    else:
        assert model.init_from_target(target.model) == [1]  # any family's weight names (family.py)
    hf_cfg = target.model.config
    eagle3 = Eagle3Model(Eagle3Config.from_target(hf_cfg, NUM_DRAFT_VOCAB, default_target_layers(2), block_size=5),
                         draft_vocab(hf_cfg.vocab_size))
    eagle3.save_pretrained(tmp_path / "eagle3")
    for name in ("dspark", "dflash", "eagle3", "mtp1"):
        path = tmp_path / name if name == "eagle3" else save_tiny_baseline(target, name, tmp_path / name)
        assert make_drafter(name, target, path=str(path)).hidden_layers
        with pytest.raises(ValueError, match="built for another target: architecture"):
            make_drafter(name, other, path=str(path))


@pytest.mark.parametrize("kind", [k for k in NATIVE if k in FAMILY_CONFIGS])
def test_the_rotary_table_gives_what_the_step_would_compute(family_targets, kind):
    """Every family here has a position-only RoPE: the runner tables cos / sin once, and a step's rows looked up
    from it are the rows computed for that step (rotary_table.py); a length-dependent RoPE is not tabled."""
    import types

    from dspark.models.target.rotary_table import is_static

    runner = TargetRunner(family_targets[kind].model, 4, 64)
    assert runner.rotary_table is not None
    x = torch.zeros(5, runner.head_dim, dtype=runner.dtype)
    positions = torch.tensor([0, 63, 7, 7, 31])
    looked_up = runner._rotary_tables(x, positions)
    table, runner.rotary_table = runner.rotary_table, None
    computed = runner._rotary_tables(x, positions)
    runner.rotary_table = table
    assert looked_up.keys() == computed.keys()
    for key, (cos, sin) in computed.items():
        torch.testing.assert_close(looked_up[key][0], cos, rtol=0, atol=2e-7)
        torch.testing.assert_close(looked_up[key][1], sin, rtol=0, atol=2e-7)
    assert not is_static(types.SimpleNamespace(rope_type="dynamic"))
    assert not is_static(types.SimpleNamespace(rope_type={"full_attention": "default", "sliding": "longrope"}))
    assert is_static(types.SimpleNamespace(rope_type={"full_attention": "default", "sliding": "linear"}))
