"""The flattened varlen runner computes exactly what the HF module computes."""

from __future__ import annotations

import torch

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import TargetModel
from dspark.models.target.runner import TargetRunner


def test_mixed_chunks_match_hf_forward_logits(tiny_target: TargetModel) -> None:
    model = tiny_target.model
    runner = TargetRunner(model, max_num_seqs=4, max_model_len=128)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, runner.vocab_size, (n,), generator=gen) for n in (20, 13, 1, 9)]
    slots = [runner.cache.allocate() for _ in seqs]
    cut = [17, 10, 1, 2]
    # prefill prefixes of different lengths in one call, then continue with mixed-length chunks
    first = runner.forward([SeqChunk(s, 0, q[:c].tolist(), c) for s, q, c in zip(slots, seqs, cut)])
    second = runner.forward([SeqChunk(s, c, q[c:].tolist(), len(q) - c)
                             for s, q, c in zip(slots, seqs, cut) if len(q) > c])
    with torch.no_grad():
        refs = [model(q[None]).logits[0] for q in seqs]
    got_first = torch.split(first.logits, cut)
    rest = [len(q) - c for q, c in zip(seqs, cut) if len(q) > c]
    got_second = torch.split(second.logits, rest)
    for ref, c, g in zip(refs, cut, got_first):
        torch.testing.assert_close(g, ref[:c], atol=1e-5, rtol=1e-5)
    j = 0
    for ref, c, q in zip(refs, cut, seqs):
        if len(q) > c:
            torch.testing.assert_close(got_second[j], ref[c:], atol=1e-5, rtol=1e-5)
            j += 1


def test_rollback_by_length_overwrites_rejected_entries(tiny_target: TargetModel) -> None:
    runner = TargetRunner(tiny_target.model, max_num_seqs=1, max_model_len=64)
    slot = runner.cache.allocate()
    seq = list(range(5, 25))
    runner.forward([SeqChunk(slot, 0, seq[:10], 1)])
    runner.forward([SeqChunk(slot, 10, [40, 41, 42, 43], 4)])  # 3 rejected drafts after seq[10]-position
    out = runner.forward([SeqChunk(slot, 10, seq[10:], 10)])  # overwrite from position 10 on
    with torch.no_grad():
        ref = tiny_target.model(torch.tensor([seq])).logits[0, 10:]
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


def test_freeing_a_slot_moves_the_last_one_without_changing_its_cache(tiny_target: TargetModel) -> None:
    runner = TargetRunner(tiny_target.model, max_num_seqs=3, max_model_len=64)
    a, b, c = (runner.cache.allocate() for _ in range(3))
    seq_c = list(range(10, 22))
    runner.forward([SeqChunk(a, 0, [5, 6, 7], 1), SeqChunk(b, 0, [8, 9], 1), SeqChunk(c, 0, seq_c[:8], 1)])
    runner.cache.lengths[c] = 8
    assert runner.cache.free(a) == c
    out = runner.forward([SeqChunk(a, 8, seq_c[8:], 4)])
    with torch.no_grad():
        ref = tiny_target.model(torch.tensor([seq_c])).logits[0, 8:]
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


def test_hidden_states_of_chosen_layers_match_hf(tiny_target: TargetModel) -> None:
    runner = TargetRunner(tiny_target.model, max_num_seqs=1, max_model_len=64)
    slot = runner.cache.allocate()
    seq = list(range(5, 17))
    out = runner.forward([SeqChunk(slot, 0, seq, 1)], hidden_layers=(0, 1, 2))
    ref = tiny_target.hidden_states(torch.tensor([seq]), [0, 1, 2])
    for layer, r in zip((0, 1, 2), ref):
        torch.testing.assert_close(out.hidden_states[layer], r[0], atol=1e-5, rtol=1e-5)


def test_every_gemm_kernel_computes_the_same_linear_at_every_row_count() -> None:
    from dspark.kernels.gemm_plan import KERNELS, PlannedLinear, blocked

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    lin = PlannedLinear(weight, bias)
    lin.pack()  # oneDNN where this build has it; "packed" falls back to F.linear otherwise
    for rows in (1, 7, 8, 9, 15, 16, 17, 31, 33):  # wx pads past 8 rows up to the next multiple of 8
        x = torch.randn(rows, 24, generator=gen)
        for kernel in (*KERNELS, blocked("linear", 1), blocked("packed", 8), blocked("wx", 16)):
            out = lin(x, kernel)
            assert out.shape == (rows, 40), kernel
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_blocked_kernels_give_each_bf16_row_what_it_gets_alone() -> None:
    """The bf16 fallback: a kernel row-invariant at b rows, run on blocks of b rows (the last one padded),
    gives every row of any count bit for bit what it gets alone, where the plan found it invariant."""
    from dspark.kernels.gemm_plan import PlannedLinear, _is_row_invariant, blocked, reference_kernel

    gen = torch.Generator().manual_seed(1)
    lin = PlannedLinear(torch.randn(256, 192, generator=gen).to(torch.bfloat16))
    lin.pack()
    reference = reference_kernel([lin])
    probe = torch.randn(64, 192, generator=gen).to(torch.bfloat16)
    for kernel, b in (("linear", 1), ("linear", 4), ("packed", 8), ("dpbf16", 1), ("dpbf16", 6)):
        if not _is_row_invariant([lin], b, kernel):
            continue  # not invariant here at b rows: the plan would not block with it either
        if not all(torch.equal(lin(probe[i:i + 1], kernel), lin(probe[i:i + 1], reference)) for i in range(64)):
            continue  # another kernel than this CPU's reference that matched it on the plan's few rows by chance
        for rows in (3, 8, 9, 37, 256):
            assert _is_row_invariant([lin], rows, blocked(kernel, b)), (kernel, b, rows)


def test_runner_matches_hf_under_every_fixed_kernel(tiny_target: TargetModel) -> None:
    from dspark.kernels.gemm_plan import KERNELS, GemmPlan

    seq = list(range(5, 30))
    with torch.no_grad():
        ref = tiny_target.model(torch.tensor([seq])).logits[0]
    for kernel in KERNELS:
        runner = TargetRunner(tiny_target.model, max_num_seqs=1, max_model_len=64, gemm_plan=GemmPlan.fixed(kernel))
        slot = runner.cache.allocate()
        first = runner.forward([SeqChunk(slot, 0, seq[:24], 24)])
        last = runner.forward([SeqChunk(slot, 24, seq[24:], 1)])  # one row: mv where chosen
        torch.testing.assert_close(torch.cat([first.logits, last.logits]), ref, atol=1e-5, rtol=1e-5)


def test_a_measured_gemm_plan_is_cached_per_machine_and_reused(tiny_target: TargetModel, tmp_path) -> None:
    from dspark.kernels import gemm_plan
    from dspark.kernels.gemm_plan import ROW_BUCKETS, PlannedLinear, plan_for

    runner = TargetRunner(tiny_target.model, max_num_seqs=1, max_model_len=16)
    gemm_plan._MEMO.clear()  # measure now, as on a new machine
    layers = [lin for ly in runner.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)]
    head = PlannedLinear(runner.lm_head.weight)
    plan = plan_for(layers, head, tmp_path)
    files = list((tmp_path / "gemm_plans").glob("*.json"))
    assert len(files) == 1
    assert set(plan.layer_kernels) == set(ROW_BUCKETS)
    assert all(set(t) >= {"linear", "wx"} for t in plan.meta["timings_ms"]["layers"].values())
    assert plan_for(layers, head, tmp_path).layer_kernels == plan.layer_kernels


def test_attention_split_into_runs_of_rows_by_length_matches_hf(tiny_target: TargetModel) -> None:
    from dspark.models.target.runner import ATTENTION_GROUP_ROWS

    num = ATTENTION_GROUP_ROWS + 9  # more rows than one run: the short run reads fewer keys
    runner = TargetRunner(tiny_target.model, max_num_seqs=num, max_model_len=160)
    runner.fused, runner.native_attention = None, False  # the SDPA path, whose calls are split by length
    gen = torch.Generator().manual_seed(3)
    lengths = [120 if i < ATTENTION_GROUP_ROWS else 6 for i in range(num)]
    seqs = [torch.randint(4, runner.vocab_size, (n + 1,), generator=gen) for n in lengths]
    slots = [runner.cache.allocate() for _ in seqs]
    runner.forward([SeqChunk(s, 0, q[:-1].tolist(), 1) for s, q in zip(slots, seqs)])
    assert len(runner._attention_groups([n + 1 for n in lengths], 1)) == 2
    out = runner.forward([SeqChunk(s, len(q) - 1, q[-1:].tolist(), 1) for s, q in zip(slots, seqs)])
    with torch.no_grad():
        refs = torch.stack([tiny_target.model(q[None]).logits[0, -1] for q in seqs])
    # fp32 in another summation order than HF's: ~1e-5 apart at most (a wrong key range is off by ~1e-1)
    torch.testing.assert_close(out.logits, refs, atol=5e-5, rtol=1e-5)
