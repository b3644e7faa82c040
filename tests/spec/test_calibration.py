"""ECE / AUC / Brier and Sequential Temperature Scaling on synthetic, known-answer data."""

from __future__ import annotations

import torch

from dspark.spec.calibration import apply_temperatures, auc, brier, ece, fit_sts


def test_ece_is_zero_for_calibrated_bins_and_positive_otherwise():
    pred = torch.tensor([0.1] * 10 + [0.9] * 10)
    label = torch.tensor([1.0] + [0.0] * 9 + [1.0] * 9 + [0.0])
    assert ece(pred, label) < 1e-6
    assert abs(ece(torch.full((10,), 0.9), torch.zeros(10)) - 0.9) < 1e-6


def test_auc_matches_hand_computed_values():
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])) == 0.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5  # ties count half
    assert brier(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])) == 0.5


def test_sts_recovers_the_temperatures_that_generated_the_data():
    """Survival is sampled from σ(z_k / T*_k) chained left to right; fitted T_k land near T*_k."""
    gen = torch.Generator().manual_seed(0)
    n, gamma = 40_000, 4
    true_t = [2.0, 0.5, 1.0, 3.0]
    logits = torch.randn(n, gamma, generator=gen) * 2 + 1
    cond = apply_temperatures(logits, true_t)
    accept = torch.rand(n, gamma, generator=gen) < cond
    survived = torch.cumprod(accept.float(), dim=1)
    valid = torch.ones(n, gamma, dtype=torch.bool)
    temps = fit_sts(logits, survived, valid)
    for fitted, true in zip(temps, true_t):
        assert abs(fitted - true) / true < 0.25, (temps, true_t)
    before = torch.cumprod(torch.sigmoid(logits), dim=1)
    after = torch.cumprod(apply_temperatures(logits, temps), dim=1)
    for k in range(gamma):
        assert ece(after[:, k], survived[:, k]) < 0.02
    assert ece(after, survived) < ece(before, survived)


def test_ece_noise_floor_is_what_a_calibrated_predictor_shows_and_shrinks_with_samples():
    from dspark.spec.calibration import ece, ece_noise_floor

    gen = torch.Generator().manual_seed(5)
    pred = torch.rand(2000, generator=gen) * 0.8 + 0.1
    floor = ece_noise_floor(pred)
    calibrated = ece(pred, (torch.rand(2000, generator=gen) < pred).float())
    off_by_8 = ece(pred, (torch.rand(2000, generator=gen) < (pred - 0.08).clamp(0, 1)).float())
    assert 0.015 < floor < 0.045  # ~0.8·sqrt(p(1-p)/n_b) in each of 16 populated bins of ~125
    assert abs(calibrated - floor) < 0.015 and off_by_8 > floor + 0.03
    assert ece_noise_floor(pred.repeat(16)) < floor / 2.5  # 16× the samples: about a quarter of the floor
