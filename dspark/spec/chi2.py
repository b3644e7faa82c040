"""One shared chi-square goodness-of-fit helper for the statistical tests and checks (no scipy)."""

from __future__ import annotations

import torch

# Per-check significance level: a correct implementation fails one check with probability
# 1e-4 over the choice of seed. Seeds are fixed, so every run gives the same verdict.
ALPHA = 1e-4

_MIN_EXPECTED_COUNT = 5.0  # cells expecting fewer are pooled, as the chi-square law needs


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test that ``observed`` counts follow ``expected_probs``.

    Both are flattened; ``expected_probs`` is renormalised. An observation in a cell with
    probability 0 gives p = 0. Cells expecting fewer than 5 counts are pooled into one.
    """
    counts = observed.flatten().to(torch.float64)
    probs = expected_probs.flatten().to(torch.float64)
    probs = probs / probs.sum()
    expected = probs * counts.sum()
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    is_small = expected < _MIN_EXPECTED_COUNT
    cell_counts = [counts[~is_small]]
    cell_expected = [expected[~is_small]]
    if bool(is_small.any()):
        cell_counts.append(counts[is_small].sum().reshape(1))
        cell_expected.append(expected[is_small].sum().reshape(1))
    counts = torch.cat(cell_counts)
    expected = torch.cat(cell_expected)
    keep = expected > 0
    counts, expected = counts[keep], expected[keep]
    num_dof = counts.numel() - 1
    if num_dof < 1:
        return 1.0
    statistic = ((counts - expected) ** 2 / expected).sum()
    # Survival function of chi2(k) at s is the regularised upper gamma Q(k/2, s/2).
    dof = torch.tensor(num_dof / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def matches(observed: torch.Tensor, expected_probs: torch.Tensor, alpha: float = ALPHA) -> bool:
    """True unless the chi-square test rejects ``expected_probs`` at level ``alpha``."""
    return chi_square_pvalue(observed, expected_probs) >= alpha


def counts_of(values: torch.Tensor, num_categories: int) -> torch.Tensor:
    """Histogram of integer ``values`` in [0, num_categories)."""
    return torch.bincount(values.flatten(), minlength=num_categories)
