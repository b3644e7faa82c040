"""The sparse nucleus sampler draws from exactly the distribution the engine's sampler draws from.

Each test compares the empirical distribution of many seeded samples with `reference_probs` (an
independent per-row temperature + top-p) by chi-square at ALPHA = 1e-4 per check, and with the
engine's own `logits_to_probs` + `sample_from_probs`; a correct sampler fails one check with
probability 1e-4 over the choice of seed (seeds are fixed, so the verdict is deterministic).
"""

from __future__ import annotations

import pytest
import torch

from dspark.spec.chi2 import ALPHA, chi_square_pvalue
from dspark.spec.nucleus import sample_nucleus
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
