"""Every dtype path is lossless against its own target-only engine, and kernels keep rows bit-stable."""

from __future__ import annotations

import pytest
import torch

from dspark.config.engine import EngineConfig
from dspark.kernels.gemm_plan import ROW_BUCKETS, PlannedLinear, measure_plan, reference_kernel
from dspark.models.target.loader import load_target
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import Request, SamplingParams
from dspark.verify_service.step.prefill import MAX_PREFILL_REQUESTS, prefill_groups
from tests.test_engine_lossless import tiny_prompts
from tests.tiny import tiny_sps_path


@pytest.fixture(scope="module")
def tiny_bf16(tiny_target_dir):
    return load_target(str(tiny_target_dir), dtype="bf16")


@pytest.mark.parametrize("scheduler", ["fixed", "greedy"])
def test_bf16_greedy_speculation_equals_bf16_target_only_decoding(tiny_bf16, scheduler):
    prompts = tiny_prompts(tiny_bf16.model.config.vocab_size)[:12]
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    def engine(drafter: str, max_num_seqs: int) -> Engine:
        return Engine(EngineConfig(target=str(tiny_bf16.path), drafter=drafter, scheduler=scheduler,
                                   scheduler_kwargs={"k": 5} if scheduler == "fixed" else {}, num_draft_tokens=7,
                                   max_num_seqs=max_num_seqs, max_model_len=256, draft_gate=False,
                                   sps_profile=tiny_sps_path(tiny_bf16.path)), target=tiny_bf16)

    solo = engine("none", 1)
    refs = [solo.generate([p], params)[0].output_ids for p in prompts]
    spec = engine("ngram", 6)
    reqs = spec.generate(prompts, params)
    assert sum(r.num_accepted for r in reqs) > 0
    assert [r.output_ids for r in reqs] == refs


def test_a_row_invariant_bf16_plan_gives_every_row_what_it_gets_alone():
    """Whatever kernel a row bucket takes, each row gets bit for bit the one-row reference of this CPU: F.linear,
    or the AVX512-BF16 kernel on a CPU that has it and no AMX (`reference_kernel`)."""
    gen = torch.Generator().manual_seed(0)
    # shapes large enough that a kernel summing in another order shows it in many outputs
    layer = PlannedLinear(torch.randn(1536, 256, generator=gen).bfloat16())
    head = PlannedLinear(torch.randn(4096, 256, generator=gen).bfloat16())
    plan = measure_plan([layer] * 4, head, num_repeats=1, row_invariant=True)
    reference = reference_kernel([layer])
    assert reference == ("dpbf16" if layer.takes_dpbf16 and not layer.takes_amx else "linear")
    for rows in ROW_BUCKETS:
        for lin, is_head in ((layer, False), (head, True)):
            x = torch.randn(rows, 256, generator=gen).bfloat16()
            out = lin(x, plan.kernel(rows, is_head))
            alone = torch.cat([lin(x[i:i + 1], reference) for i in range(rows)])
            assert torch.equal(out, alone), (rows, plan.kernel(rows, is_head))
    assert set(plan.meta["row_variant"]["layers"]) == set(ROW_BUCKETS)  # every bucket was checked


def test_prefill_is_split_into_bounded_groups_of_consecutive_requests():
    reqs = [Request(f"r{i}", [1] * n, SamplingParams(), None) for i, n in enumerate([10] * 70 + [4000, 200, 300])]
    groups = prefill_groups(reqs)
    assert [r for g in groups for r in g] == reqs  # order kept: slots stay contiguous per group
    assert all(len(g) <= MAX_PREFILL_REQUESTS for g in groups)
    assert all(sum(len(r.prompt_ids) for r in g) <= 4096 or len(g) == 1 for g in groups)
