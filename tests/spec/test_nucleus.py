"""The sparse nucleus sampler draws from exactly the distribution the engine's sampler draws from.

Each test compares the empirical distribution of many seeded samples with `reference_probs` (an
independent per-row temperature + top-p) by chi-square at ALPHA = 1e-4 per check, and with the
engine's own `logits_to_probs` + `sample_from_probs`; a correct sampler fails one check with
probability 1e-4 over the choice of seed (seeds are fixed, so the verdict is deterministic).
"""

from __future__ import annotations

import pytest
import torch

from dspark.kernels import native
from dspark.spec.chi2 import ALPHA, chi_square_pvalue
from dspark.spec.nucleus import NATIVE_CANDIDATE_CAP, _sample_native, _sample_torch, sample_nucleus
from dspark.spec.sampling import exponential_noise, logits_to_probs, sample_from_probs

from .test_lossless import reference_probs

NUM_SAMPLES = 30_000


def _logits(vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, vocab, generator=gen) * 2.5).float()


def _nucleus_counts(logits: torch.Tensor, temperature: float, top_p: float, seed: int) -> torch.Tensor:
    rows = logits.repeat(NUM_SAMPLES, 1)
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(NUM_SAMPLES)]
    tokens = sample_nucleus(rows, [temperature] * NUM_SAMPLES, [top_p] * NUM_SAMPLES, gens)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[1])


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 0.5), (0.7, 1.0), (1.3, 0.95)])
def test_nucleus_samples_follow_the_filtered_target_distribution(temperature: float, top_p: float) -> None:
    logits = _logits(40, seed=3)
    expected = reference_probs(logits, temperature, top_p)[0]
    counts = _nucleus_counts(logits, temperature, top_p, seed=1)
    assert chi_square_pvalue(counts, expected) > ALPHA
    assert int(counts[expected == 0].sum()) == 0  # nothing outside the nucleus, ever


def test_nucleus_and_engine_sampler_agree_in_distribution() -> None:
    logits = _logits(40, seed=5)
    gen = torch.Generator().manual_seed(7)
    probs = logits_to_probs(logits, torch.tensor([0.7]), torch.tensor([0.9]))
    engine_tokens = [int(sample_from_probs(probs, exponential_noise(probs.shape, gen, None))[0])
                     for _ in range(NUM_SAMPLES)]
    engine_counts = torch.bincount(torch.tensor(engine_tokens), minlength=40)
    ours = _nucleus_counts(logits, 0.7, 0.9, seed=2)
    # two-sample check: our counts against the engine sampler's empirical law (smoothed)
    assert chi_square_pvalue(ours, (engine_counts.double() + 0.5) * (probs[0] > 0)) > ALPHA


def test_greedy_rows_take_the_argmax_and_mixed_batches_keep_row_order() -> None:
    logits = torch.randn(37, 1000, generator=torch.Generator().manual_seed(0))
    temps = [0.0 if i % 3 == 0 else 0.8 for i in range(37)]
    gens = [torch.Generator().manual_seed(i) for i in range(37)]
    tokens = sample_nucleus(logits, temps, [0.9] * 37, gens)
    argmax = logits.argmax(dim=-1).tolist()
    assert [t for t, temp in zip(tokens, temps) if temp == 0] == [a for a, temp in zip(argmax, temps) if temp == 0]
    probs = logits_to_probs(logits, torch.tensor(temps), torch.full((37,), 0.9))
    assert all(probs[r, t] > 0 for r, t in enumerate(tokens))  # every sample inside its row's nucleus


def test_the_callers_logits_are_left_untouched() -> None:
    logits = torch.randn(4, 100)
    before = logits.clone()
    sample_nucleus(logits, [0.7] * 4, [0.9] * 4, [None] * 4)
    assert torch.equal(logits, before)


def test_the_same_seed_gives_the_same_tokens() -> None:
    logits = torch.randn(8, 500)
    a = sample_nucleus(logits, [0.9] * 8, [0.9] * 8, [torch.Generator().manual_seed(i) for i in range(8)])
    b = sample_nucleus(logits, [0.9] * 8, [0.9] * 8, [torch.Generator().manual_seed(i) for i in range(8)])
    assert a == b


@pytest.mark.skipif(not native.is_available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_candidate_pass_follows_the_filtered_distribution_in_fp32_and_bf16(dtype: torch.dtype) -> None:
    logits = _logits(40, seed=11).to(dtype)
    expected = reference_probs(logits.float(), 0.7, 0.9)[0]
    rows = logits.repeat(NUM_SAMPLES, 1)
    gens = [torch.Generator().manual_seed(5_000_011 + i) for i in range(NUM_SAMPLES)]
    tokens = _sample_native(rows, [0.7] * NUM_SAMPLES, [0.9] * NUM_SAMPLES, gens)
    counts = torch.bincount(torch.tensor(tokens), minlength=40)
    assert chi_square_pvalue(counts, expected) > ALPHA
    assert int(counts[expected == 0].sum()) == 0


@pytest.mark.skipif(not native.is_available(), reason="no C compiler on this machine")
def test_native_pass_matches_the_pytorch_passes_row_for_row() -> None:
    """Same candidates, same draws: greedy, nucleus, top-p 1 and over-the-cap rows in one batch."""
    gen = torch.Generator().manual_seed(4)
    vocab = 6000
    logits = torch.randn(6, vocab, generator=gen) * 3
    logits[4] = 0.0  # a flat row: every token is a candidate, more than the native cap
    temps, top_p = [0.0, 0.7, 1.0, 0.7, 1.0, 0.5], [0.9, 0.9, 0.95, 1.0, 0.9, 0.5]
    ours = _sample_native(logits, temps, top_p, [torch.Generator().manual_seed(i) for i in range(6)])
    theirs = _sample_torch(logits, temps, top_p, [torch.Generator().manual_seed(i) for i in range(6)])
    assert ours == theirs
    assert native.nucleus_candidates(logits[4:5], [1.0], [0.05 / vocab], NATIVE_CANDIDATE_CAP).count[0] == vocab


def test_tied_tokens_at_the_nucleus_boundary_are_cut_as_the_engine_sampler_cuts_them() -> None:
    """bf16 logits tie often; the lower id of a tie goes first in both samplers' orders (stable sorts)."""
    logits = torch.tensor([[0.0, 1.0, 3.0, 1.0, 2.0, -1.0, 1.0]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits.float(), torch.tensor([1.0]), torch.tensor([0.8]))
    support = set(probs[0].nonzero().flatten().tolist())
    assert support == {2, 4, 1}  # ids 1, 3 and 6 tie: only the first is needed to reach 0.8
    n = 3000
    for fn in (_sample_torch, _sample_native) if native.is_available() else (_sample_torch,):
        tokens = fn(logits.repeat(n, 1), [1.0] * n, [0.8] * n, [torch.Generator().manual_seed(i) for i in range(n)])
        assert set(tokens) == support
