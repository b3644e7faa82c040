"""logits_to_probs, exponential-race sampling and Exp(1) noise."""

from __future__ import annotations

import math

import torch

from dspark.spec.chi2 import ALPHA, chi_square_pvalue, counts_of
from dspark.spec.sampling import exponential_noise, logits_to_probs, sample_from_probs


def _probs(logits: list[list[float]], temperature: list[float], top_p: list[float]) -> torch.Tensor:
    return logits_to_probs(torch.tensor(logits), torch.tensor(temperature), torch.tensor(top_p))


def test_greedy_rows_are_one_hot_at_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, torch.tensor([0.0, 0.0]), torch.tensor([0.5, 1.0]))
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_greedy_and_sampled_rows_mix_in_one_call() -> None:
    probs = _probs([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]], [0.0, 1.0], [1.0, 1.0])
    assert probs[0].tolist() == [0.0, 0.0, 1.0]
    torch.testing.assert_close(probs[1], torch.softmax(torch.tensor([0.0, 1.0, 2.0]), -1))


def test_temperature_divides_the_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]] * 3)
    temperature = torch.tensor([1.0, 0.5, 2.0])
    probs = logits_to_probs(logits, temperature, torch.ones(3))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature[:, None], -1))
    # Lower temperature sharpens: the top token gains mass.
    assert probs[1, 1] > probs[0, 1] > probs[2, 1]


def test_top_p_keeps_the_smallest_prefix_reaching_top_p() -> None:
    base = [0.05, 0.5, 0.15, 0.3]  # sorted: 0.5 (1), 0.3 (3), 0.15 (2), 0.05 (0)
    logits = [[math.log(p) for p in base]] * 5
    probs = _probs(logits, [1.0] * 5, [0.01, 0.45, 0.75, 0.85, 1.0])
    expected = torch.tensor(
        [
            [0.0, 1.0, 0.0, 0.0],  # the top token is always kept
            [0.0, 1.0, 0.0, 0.0],
            [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8],
            [0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95],
            base,
        ]
    )
    torch.testing.assert_close(probs, expected)


def test_top_p_applies_after_temperature() -> None:
    logits = [[math.log(0.6), math.log(0.4)]]
    # At T=1 the top token alone (0.6) misses top_p = 0.65 ...
    assert _probs(logits, [1.0], [0.65])[0, 1] > 0
    # ... at T=0.25 it has 0.6^4 / (0.6^4 + 0.4^4) = 0.835 and suffices.
    assert _probs(logits, [0.25], [0.65]).tolist() == [[1.0, 0.0]]


def test_rows_are_normalised_fp32_for_half_precision_logits() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)).half()
    probs = logits_to_probs(logits, torch.full((8,), 0.8), torch.full((8,), 0.9))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))


def test_exponential_race_frequencies_match_probs() -> None:
    """200k draws from one distribution; false-failure odds ALPHA = 1e-4."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    num_draws = 200_000
    noise = exponential_noise((num_draws, 6), torch.Generator().manual_seed(3), "cpu")
    samples = sample_from_probs(probs.expand(num_draws, 6), noise)
    assert samples.dtype == torch.long
    assert chi_square_pvalue(counts_of(samples, 6), probs) >= ALPHA
    assert int((samples == 5).sum()) == 0  # zero-probability tokens never win


def test_exponential_race_ignores_row_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    probs = torch.rand(100, 7, generator=gen)
    noise = exponential_noise((100, 7), gen, "cpu")
    assert torch.equal(sample_from_probs(probs, noise), sample_from_probs(probs * 13.0, noise))


def test_exponential_race_with_zero_noise_never_picks_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0]])
    assert sample_from_probs(probs, torch.zeros(1, 3)).tolist() == [1]


def test_exponential_noise_is_positive_unit_mean_and_seeded() -> None:
    """Mean of 1e6 Exp(1) draws is within 5 standard errors of 1 (odds ~6e-7)."""
    first = exponential_noise((1_000_000,), torch.Generator().manual_seed(7), "cpu")
    again = exponential_noise((1_000_000,), torch.Generator().manual_seed(7), "cpu")
    assert first.dtype == torch.float32
    assert torch.equal(first, again)
    assert bool((first > 0).all()) and bool(torch.isfinite(first).all())
    assert abs(float(first.mean()) - 1.0) < 5 / math.sqrt(1_000_000)
