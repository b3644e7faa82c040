"""The native CPU kernels (compiled here with the system C compiler) compute what PyTorch computes, and the
runner's native forwards match the HF module: the fused few-token path and the native-attention path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels import native
from dspark.kernels.gemm_plan import GemmPlan
from dspark.models.target.layer import SeqChunk, rms_norm
from dspark.models.target.loader import TargetModel, load_target
from dspark.models.target.runner import TargetRunner

pytestmark = pytest.mark.skipif(not native.is_available(), reason="no C compiler on this machine")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_native_gemm_matches_linear_and_its_rows_do_not_depend_on_the_row_count(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(70, 45, generator=gen)
    x = torch.randn(rows, 45, generator=gen)
    packed = native.pack(w)
    got = native.linear(x, packed, 70)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
    alone = torch.cat([native.linear(x[i:i + 1], packed, 70) for i in range(rows)])
    assert torch.equal(got, alone)  # the same reduction order whatever else the step carries


@pytest.mark.skipif(not native.supports_amx(torch.zeros(32, 32, dtype=torch.bfloat16)),
                    reason="this CPU (or build) has no AMX-BF16")
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 70])
def test_amx_gemm_gives_each_bf16_row_what_it_gets_alone_and_what_f_linear_gives(rows: int) -> None:
    """The AMX kernel on a verify step's row counts: each row bit for bit what it gets alone (partial tiles of 16
    rows included), and (on the AMX Xeon) what F.linear gives it; the plan checks the latter before it picks the
    kernel at a row count (gemm_plan._is_row_invariant)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 160, generator=gen).to(torch.bfloat16)
    packed = native.amx_pack(w)
    got = native.amx_linear(x, packed, 96)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)
    alone = torch.cat([native.amx_linear(x[i:i + 1], packed, 96) for i in range(rows)])
    assert torch.equal(got, alone)


@pytest.mark.skipif(not native.supports_dpbf16(torch.zeros(32, 32, dtype=torch.bfloat16)),
                    reason="this CPU (or build) has no AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 32, 70, 100])
def test_avx512_bf16_gemm_gives_each_row_what_it_gets_alone_and_what_fp32_gives_rounded_to_bf16(rows: int) -> None:
    """The AVX512-BF16 kernel (the bf16 GEMM of CPUs without AMX) on a verify step's row counts: each row bit for
    bit what it gets alone (tiles of 6 rows, partial ones included; 1-2 rows one whole-K pass, from 3 to 96 rows K in
    blocks with the sums parked between them, the last block partial here; past 96 whole-K passes again), whatever
    rows share its step, and each output within bf16 rounding of the product in fp32 of the same bf16 inputs."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 160, generator=gen).to(torch.bfloat16)
    packed = native.amx_pack(w)  # the AMX tile layout, read pair by pair
    got = native.dpbf16_linear(x, packed, 96)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    exact = F.linear(x.float(), w.float())
    assert ((got.float() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-3).all()  # one bf16 rounding (8-bit mantissa)
    alone = torch.cat([native.dpbf16_linear(x[i:i + 1], packed, 96) for i in range(rows)])
    assert torch.equal(got, alone)
    if rows > 2:
        assert torch.equal(native.dpbf16_linear(x[1:-1], packed, 96), got[1:-1])


@pytest.mark.skipif(not native.supports_dpbf16(torch.zeros(32, 32, dtype=torch.bfloat16)),
                    reason="this CPU (or build) has no AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 4, 8, 12])
def test_avx512_bf16_gemm_writes_every_column_pair_whatever_the_thread_count(rows: int) -> None:
    """The column pairs are split into one range per thread, taken from the front by its owner and from the back by
    threads done with their own: with more threads than pairs, an odd count, or one, every output is written
    and equals what the step's thread count gives bit for bit (13 pairs, the output filled with NaN before)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(13 * 32, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    packed = native.amx_pack(w)
    one = native.dpbf16_linear(x, packed, 13 * 32)
    for threads in (1, 2, 3, 5, 16):
        y = torch.full((rows, 13 * 32), float("nan"), dtype=torch.bfloat16)
        native.library().gemm_dpbf16(x.data_ptr(), packed.data_ptr(), y.data_ptr(), rows, 64, 13 * 32, threads)
        assert torch.equal(y, one), threads
    exact = F.linear(x.float(), w.float())
    assert ((one.float() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-3).all()


def test_amx_is_offered_only_for_bf16_weights_it_can_tile() -> None:
    from dspark.kernels.gemm_plan import PlannedLinear

    assert not native.supports_amx(torch.zeros(64, 64))  # fp32
    assert not native.supports_amx(torch.zeros(40, 64, dtype=torch.bfloat16))  # 40 outputs: not whole tile pairs
    lin = PlannedLinear(torch.randn(40, 24))  # where it cannot, "amx" is F.linear (as "packed" without oneDNN)
    x = torch.randn(3, 24)
    torch.testing.assert_close(lin(x, "amx"), F.linear(x, lin.weight))
    assert not native.supports_dpbf16(torch.zeros(64, 64))  # the AVX512-BF16 kernel likewise
    assert not native.supports_dpbf16(torch.zeros(40, 64, dtype=torch.bfloat16))
    torch.testing.assert_close(lin(x, "dpbf16"), F.linear(x, lin.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_argmax_rows_is_torch_max_indices(dtype: torch.dtype) -> None:
    """Greedy acceptance's argmax: the same index as torch.max(dim=-1) on every row, including ties (the first),
    -0 beside +0, a row of -inf, NaNs (the first NaN), rows not a multiple of the vector width, and a strided view."""
    gen = torch.Generator().manual_seed(11)
    for vocab in (49152, 1000, 37, 5):
        x = (torch.randn(40, vocab, generator=gen) * 3).to(dtype)
        x[0, vocab // 3] = x[0, vocab - 1] = x[0].max() + 1  # a tie
        x[1, vocab // 2] = float("nan")
        x[1, vocab - 1] = float("nan")
        x[2] = -float("inf")
        x[3] = 0.0
        x[3, vocab // 2] = -0.0
        x[4, 0] = float("inf")
        x[5] = x[5].round()  # many equal values
        assert torch.equal(native.argmax_rows(x), x.max(dim=-1).indices), vocab
        view = torch.randn(12, 2 * vocab, generator=gen).to(dtype)[:, :vocab]  # rows apart by their stride
        assert torch.equal(native.argmax_rows(view), view.max(dim=-1).indices)


def test_the_native_bf16_norm_and_silu_find_torchs_rounding_on_this_machine() -> None:
    """With the pinned torch on x86-64, both start-up probes succeed (else the forward silently goes back to
    PyTorch's ops: slower, never wrong); a torch that sums or rounds otherwise fails here, to be looked at."""
    if not native.is_available():
        pytest.skip("no native kernels on this machine")
    assert native.bf16_norm_lanes() in (16, 8, 4)
    table = native.silu_bf16_table()
    assert table is not None and table.shape == (1 << 16,) and table.dtype == torch.float32


def test_the_aten_order_sum_is_torch_sum_at_the_width_found_and_not_at_the_others() -> None:
    """The native sum that the bf16 norm adds its squares with reproduces torch.sum's rows to the bit at the width
    `bf16_norm_lanes` found (rows of any length: shorter than a vector, leftover vectors and scalars, the
    cascade's upper levels), and the other widths do not: the probe tells them apart."""
    lanes = native.bf16_norm_lanes()
    if lanes is None:
        pytest.skip("torch sums in an order the native kernels do not reproduce on this machine")
    gen = torch.Generator().manual_seed(3)
    for n in (1, 3, 7, 9, 33, 576, 577, 1536, 2051, 100003):
        x = torch.rand(16, n, generator=gen) * 2.0 ** torch.randint(-10, 10, (16, 1), generator=gen)
        assert torch.equal(native.aten_order_row_sums(x, lanes), x.sum(-1)), n
    x = torch.rand(64, 576, generator=gen)
    for other in {16, 8, 4} - {lanes}:
        assert not torch.equal(native.aten_order_row_sums(x, other), x.sum(-1))


@pytest.mark.parametrize("rows", [1, 7, 32, 150, 1000])  # from 8 rows of 576 on, rows are shared out to threads
def test_bf16_norm_and_residual_are_pytorchs_to_the_bit_and_per_row(rows: int) -> None:
    """The native bf16 pass that replaces the residual add and PyTorch's composite RMSNorm gives their results bit
    for bit (a norm one bf16 ulp off in a few elements per million moved greedy texts in session 46), on hidden
    states of SmolLM2's scale and on rows with outliers, and each row's result is the same alone as in a batch."""
    if native.bf16_norm_lanes() is None:
        pytest.skip("no native bf16 norm that rounds as torch's does on this machine")
    gen = torch.Generator().manual_seed(rows)
    for d, scale in ((576, 3.0), (576, 40.0), (960, 1.0), (100, 8.0)):
        x = (torch.randn(rows, d, generator=gen) * scale).to(torch.bfloat16)
        x[:, ::97] *= 50  # a few large features, as real hidden states have
        r = torch.randn(rows, d, generator=gen).to(torch.bfloat16)
        w = (torch.rand(d, generator=gen) + 0.5).to(torch.bfloat16)
        total, normed = native.add_rms_norm(x, r, w, 1e-5)
        assert total.dtype == normed.dtype == torch.bfloat16 and torch.equal(total, x + r)
        assert torch.equal(normed, F.rms_norm(x + r, (d,), w, 1e-5))
        assert torch.equal(native.rms_norm(x, w, 1e-6), F.rms_norm(x, (d,), w, 1e-6))
        assert torch.equal(torch.cat([native.add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-5)[1]
                                      for i in range(min(rows, 40))]), normed[:40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 60, 64, 70])
def test_row_major_copies_a_transposed_head_output_exactly(dtype: torch.dtype, rows: int) -> None:
    """W @ xᵀ's output (a transposed view, its storage padded past `rows` columns) comes back row-major and
    equal element for element; a tensor that is neither such a view nor contiguous goes through `contiguous`."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 16, generator=gen).to(dtype)
    x = torch.randn(rows + (-rows % 8), 16, generator=gen).to(dtype)
    view = torch.mm(weight, x.t()).t()[:rows]  # (rows, 300), strides (1, padded rows)
    got = native.row_major(view)
    assert got.is_contiguous() and got.dtype == dtype and torch.equal(got, view)
    other = torch.randn(20, 30, generator=gen).to(dtype)[:, ::2]
    assert torch.equal(native.row_major(other), other) and native.row_major(other).is_contiguous()


def test_the_runner_hands_out_row_major_logits_whatever_the_head_kernel(tiny_target: TargetModel) -> None:
    """Every consumer of the logits reduces over a token's row (greedy acceptance, sampling): the runner never
    hands them the transposed view that W @ xᵀ leaves, and the values are those of the plain head."""
    runner = TargetRunner(tiny_target.model, 2, 64)
    rows = torch.randn(11, runner.lm_head.weight.shape[1])
    for kernel in ("wx", "linear"):
        runner.gemm_plan = GemmPlan.fixed(kernel)
        logits = runner.logits(rows)
        assert logits.is_contiguous()
        torch.testing.assert_close(logits, runner.lm_head(rms_norm(rows, runner.final_norm, runner.eps), "linear"),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_is_causal_per_slot_and_matches_sdpa(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv, hd, max_len = 6, 2, 16, 40
    k_cache = torch.randn(3, max_len, num_kv, hd, generator=gen).to(dtype)
    v_cache = torch.randn(3, max_len, num_kv, hd, generator=gen).to(dtype)
    slots, positions = [2, 0, 0, 1], [7, 30, 31, 0]  # two tokens of one slot: the first must not see the second
    qk = torch.randn(4, num_heads + num_kv, hd, generator=gen).to(dtype)
    key_row = torch.tensor(slots) * max_len
    num_keys = torch.tensor(positions) + 1
    out = native.attention(qk, num_heads, k_cache, v_cache, key_row, num_keys, 32, hd ** -0.5)
    assert out.dtype == dtype
    for t, (s, p) in enumerate(zip(slots, positions)):
        q = qk[t, :num_heads][:, None, :].float()  # (H, 1, hd); the reference in fp32 on the same inputs
        k = k_cache[s, :p + 1].transpose(0, 1).repeat_interleave(num_heads // num_kv, 0).float()  # (H, p+1, hd)
        v = v_cache[s, :p + 1].transpose(0, 1).repeat_interleave(num_heads // num_kv, 0).float()
        ref = F.scaled_dot_product_attention(q, k, v).reshape(-1).to(dtype)  # bf16: rounded once, as ours
        torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 32])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4), (10, 2)])
def test_native_attention_gives_each_token_what_it_gets_alone_in_pieces_of_any_size(dtype: torch.dtype, hd: int,
                                                                                     heads: tuple[int, int]) -> None:
    """Verify chunks of 1 + l tokens of one slot are one piece (their keys transposed once, their value rows read
    once a tile of query heads): every token's output is bit for bit what it gets in a step of its own, at key
    counts on both sides of the 16-key blocks (odd and even: bf16 P.V takes keys in pairs), with 1, 3, 5 or 8 query
    heads a KV head (P.V tiles of up to 6 heads full and partial), and within bf16 rounding of an fp32 reference;
    the unwritten (NaN) cache rows past a slot's keys change nothing."""
    gen = torch.Generator().manual_seed(5)
    (num_heads, num_kv), max_len = heads, 64
    k_cache = torch.randn(4, max_len, num_kv, hd, generator=gen).to(dtype)
    v_cache = torch.randn(4, max_len, num_kv, hd, generator=gen).to(dtype)
    starts, lengths = [15, 0, 31, 40], [5, 8, 2, 1]  # chunks of 5, 8, 2 and 1 token(s) over slots 0..3
    for s, (p, n) in enumerate(zip(starts, lengths)):  # rows past a slot's keys never written: nothing of them leaks
        k_cache[s, p + n:] = v_cache[s, p + n:] = float("nan")
    key_row = torch.tensor([s * max_len for s, n in enumerate(lengths) for _ in range(n)])
    num_keys = torch.tensor([p + i + 1 for p, n in zip(starts, lengths) for i in range(n)])
    qk = torch.randn(len(key_row), num_heads + 2 * num_kv, hd, generator=gen).to(dtype)
    mk = int(num_keys.max())
    together = native.attention(qk, num_heads, k_cache, v_cache, key_row, num_keys, mk, hd ** -0.5)
    for t in range(len(key_row)):
        alone = native.attention(qk[t:t + 1].contiguous(), num_heads, k_cache, v_cache, key_row[t:t + 1],
                                 num_keys[t:t + 1], mk, hd ** -0.5)
        assert torch.equal(alone[0], together[t]), t
        s, n = int(key_row[t]) // max_len, int(num_keys[t])
        q = qk[t, :num_heads][:, None, :].float()
        k = k_cache[s, :n].transpose(0, 1).repeat_interleave(num_heads // num_kv, 0).float()
        v = v_cache[s, :n].transpose(0, 1).repeat_interleave(num_heads // num_kv, 0).float()
        ref = F.scaled_dot_product_attention(q, k, v).reshape(-1)
        torch.testing.assert_close(together[t].float(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 8e-3)


def test_bf16_runners_take_native_attention_as_close_to_fp32_as_sdpa(tiny_target_dir) -> None:
    """bf16 generation and bf16 verification both attend in native code (the kernel computes each token
    alone, so verification stays row-invariant). Both paths are bf16 roundings of the fp32 model: the
    native path must be about as close to it as the SDPA path."""
    plan = GemmPlan.fixed("linear")
    bf16 = load_target(str(tiny_target_dir), "cpu", "bf16").model
    fp32 = load_target(str(tiny_target_dir), "cpu", "fp32").model
    runners = [TargetRunner(bf16, 2, 64, gemm_plan=plan, row_invariant=False),
               TargetRunner(bf16, 2, 64, gemm_plan=plan, row_invariant=True),
               TargetRunner(fp32, 2, 64, gemm_plan=plan)]
    assert runners[0].native_attention and runners[1].native_attention
    runners[1].native_attention = False  # the key-block-padded SDPA path, for comparison
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(4, runners[0].vocab_size, (n,), generator=gen).tolist() for n in (23, 11)]
    logits = []
    for runner in runners:
        slots = [runner.cache.allocate() for _ in seqs]
        runner.forward([SeqChunk(s, 0, q[:-2], 1) for s, q in zip(slots, seqs)])  # prefill (SDPA in all)
        logits.append(runner.forward([SeqChunk(s, len(q) - 2, q[-2:], 2) for s, q in zip(slots, seqs)])
                      .logits.float())
    native_err, sdpa_err = ((x - logits[2]).abs().max() for x in logits[:2])
    assert native_err <= 2 * sdpa_err and native_err < 0.05 * logits[2].abs().max()


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40 rows of 1536: past the serial threshold, rows shared out
def test_bf16_silu_mul_is_pytorchs_to_the_bit_and_per_row(rows: int) -> None:
    """The native bf16 SiLU·up (PyTorch's own SiLU of every bf16 value looked up, times up, rounded) gives F.silu's
    chunk times up bit for bit (±0 and infinities included; a NaN stays a NaN), and each row's result is the same
    alone as in a batch."""
    if native.silu_bf16_table() is None:
        pytest.skip("no native bf16 SiLU that rounds as torch's does on this machine")
    gen = torch.Generator().manual_seed(rows)
    for inter, scale in ((1536, 3.0), (1536, 30.0), (1000, 1.0), (24, 5.0)):
        gate_up = (torch.randn(rows, 2 * inter, generator=gen) * scale).to(torch.bfloat16)
        gate_up[0, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
        gate, up = gate_up.chunk(2, dim=-1)
        got, want = native.silu_mul(gate_up), F.silu(gate) * up
        assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])  # ±0 too
        assert torch.equal(torch.cat([native.silu_mul(gate_up[i:i + 1]) for i in range(rows)]).view(torch.int16),
                           got.view(torch.int16))


def test_a_bf16_forward_with_the_native_norms_and_silu_is_pytorchs_to_the_bit(tiny_target_dir, monkeypatch) -> None:
    """The bf16 verify path (native attention, the residual carried into the next layer's norm pass, SiLU·up in
    one pass) gives the same logits and hidden states with the native norms and SiLU·up as with PyTorch's ops:
    greedy texts, and the self-distilled corpus the suffix source matches them against, stay what they were."""
    if native.bf16_norm_lanes() is None or native.silu_bf16_table() is None:
        pytest.skip("no native bf16 norm or SiLU that rounds as torch's does on this machine")
    bf16 = load_target(str(tiny_target_dir), "cpu", "bf16").model
    runner = TargetRunner(bf16, 3, 64, gemm_plan=GemmPlan.fixed("linear"), row_invariant=True)
    assert runner.native_attention
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(4, runner.vocab_size, (n,), generator=gen).tolist() for n in (30, 12, 21)]
    lanes, table = native.bf16_norm_lanes(), native.silu_bf16_table()
    outs = []
    for on in (True, False):
        monkeypatch.setattr(native, "bf16_norm_lanes", (lambda: lanes) if on else (lambda: None))
        monkeypatch.setattr(native, "silu_bf16_table", (lambda: table) if on else (lambda: None))
        runner.cache = type(runner.cache)(runner.num_layers, runner.num_kv_heads, runner.head_dim, 3, 64,
                                          runner.dtype, runner.device)
        slots = [runner.cache.allocate() for _ in seqs]
        runner.forward([SeqChunk(s, 0, q[:-4], 1) for s, q in zip(slots, seqs)])
        outs.append(runner.forward([SeqChunk(s, len(q) - 4, q[-4:], 4) for s, q in zip(slots, seqs)],
                                   hidden_layers=(1, runner.num_layers)))
    assert torch.equal(outs[0].logits, outs[1].logits)
    for layer in (1, runner.num_layers):
        assert torch.equal(outs[0].hidden_states[layer], outs[1].hidden_states[layer])


@pytest.mark.parametrize("path", ["fused", "native_attention"])
def test_native_forwards_match_hf_logits_and_hidden_states(tiny_target: TargetModel, path: str) -> None:
    model = tiny_target.model
    plan = GemmPlan.fixed("native" if path == "fused" else "linear")
    runner = TargetRunner(model, max_num_seqs=3, max_model_len=64, gemm_plan=plan)
    assert (runner.fused is not None) == (path == "fused") and runner.native_attention
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, runner.vocab_size, (n,), generator=gen) for n in (20, 9, 14)]
    slots = [runner.cache.allocate() for _ in seqs]
    cut = [17, 8, 3]
    runner.forward([SeqChunk(s, 0, q[:c].tolist(), 1) for s, q, c in zip(slots, seqs, cut)])
    # verify-like chunks in non-slot order, with hidden states for a drafter's tapped layers
    order = [2, 0, 1]
    out = runner.forward([SeqChunk(slots[i], cut[i], seqs[i][cut[i]:].tolist(), len(seqs[i]) - cut[i])
                          for i in order], hidden_layers=(0, 1, runner.num_layers))
    with torch.no_grad():
        ref = [model(q[None], output_hidden_states=True) for q in seqs]
    got = torch.split(out.logits, [len(seqs[i]) - cut[i] for i in order])
    start = 0
    for g, i in zip(got, order):
        torch.testing.assert_close(g, ref[i].logits[0, cut[i]:], atol=1e-5, rtol=1e-5)
        n = len(seqs[i]) - cut[i]
        for layer in (0, 1):  # the last one HF returns after the final norm
            torch.testing.assert_close(out.hidden_states[layer][start:start + n],
                                       ref[i].hidden_states[layer][0, cut[i]:], atol=1e-5, rtol=1e-5)
        start += n


def test_fused_decoding_is_greedy_identical_to_hf_generate(tiny_target: TargetModel) -> None:
    model = tiny_target.model
    runner = TargetRunner(model, max_num_seqs=1, max_model_len=64, gemm_plan=GemmPlan.fixed("native"))
    prompt = [5, 17, 9, 33, 2, 41]
    slot = runner.cache.allocate()
    logits = runner.forward([SeqChunk(slot, 0, prompt, 1)]).logits
    tokens = []
    for step in range(24):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.forward([SeqChunk(slot, len(prompt) + step, tokens[-1:], 1)]).logits
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert tokens == ref[0, len(prompt):].tolist()


def test_dspark_native_0_switches_the_kernels_off_and_the_plan_to_pytorch(monkeypatch, tiny_target) -> None:
    monkeypatch.setenv("DSPARK_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert not native.is_available()
        runner = TargetRunner(tiny_target.model, max_num_seqs=1, max_model_len=32)
        assert runner.fused is None and not runner.native_attention
        plan = runner.gemm_plan
        assert "native" not in set(plan.layer_kernels.values()) | set(plan.head_kernels.values())
    finally:
        monkeypatch.delenv("DSPARK_NATIVE")
        native.library.cache_clear()
    assert native.is_available()
