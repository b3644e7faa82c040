"""Calibration of prefix-survival estimates: ECE, AUC, Brier, Sequential Temperature Scaling (STS)."""

from __future__ import annotations

import torch

DEFAULT_TEMPERATURE_GRID = tuple(round(0.1 * 1.05 ** i, 4) for i in range(95))  # 0.1 .. ~10, geometric


def ece(pred: torch.Tensor, label: torch.Tensor, num_bins: int = 20) -> float:
    """Expected calibration error with equal-width bins: Σ_b (n_b/n) |mean pred_b − mean label_b|."""
    pred, label = pred.flatten().float(), label.flatten().float()
    if pred.numel() == 0:
        return 0.0
    idx = (pred * num_bins).long().clamp(0, num_bins - 1)
    sum_p = torch.bincount(idx, weights=pred, minlength=num_bins)
    sum_y = torch.bincount(idx, weights=label, minlength=num_bins)
    return float((sum_p - sum_y).abs().sum() / pred.numel())


def ece_noise_floor(pred: torch.Tensor, num_bins: int = 20, num_draws: int = 16, seed: int = 0) -> float:
    """The ECE a PERFECTLY calibrated predictor shows on as many samples as `pred`: the mean ECE of labels drawn
    as Bernoulli(pred). A finite set's ECE is biased upward by sampling noise (about 0.8·sqrt(p(1-p)/n_b) per
    bin of n_b samples: ~3 % with 2,000 samples in ten bins), so a measured ECE near this floor says the
    predictor cannot be told apart from a calibrated one on this data."""
    pred = pred.flatten().float()
    if pred.numel() == 0:
        return 0.0
    gen = torch.Generator().manual_seed(seed)
    draws = [ece(pred, (torch.rand(pred.shape, generator=gen) < pred).float(), num_bins) for _ in range(num_draws)]
    return sum(draws) / num_draws


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred.float() - label.float()) ** 2).mean()) if pred.numel() else 0.0


def auc(pred: torch.Tensor, label: torch.Tensor) -> float:
    """ROC AUC for binary labels (rank statistic with ties averaged); 0.5 when one class is missing."""
    pred, label = pred.flatten().double(), label.flatten().bool()
    num_pos, num_neg = int(label.sum()), int((~label).sum())
    if num_pos == 0 or num_neg == 0:
        return 0.5
    order = torch.argsort(pred)
    ranks = torch.empty_like(pred)
    ranks[order] = torch.arange(1, pred.numel() + 1, dtype=torch.double)
    sorted_pred = pred[order]
    uniq, inverse = torch.unique_consecutive(sorted_pred, return_inverse=True)
    mean_rank = torch.zeros(len(uniq), dtype=torch.double).index_add_(0, inverse, ranks[order])
    mean_rank /= torch.bincount(inverse, minlength=len(uniq)).double()
    ranks[order] = mean_rank[inverse]
    return float((ranks[label].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def apply_temperatures(conf_logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """σ(logit_k / T_k) per position k: (n, γ) → conditional confidences (n, γ)."""
    t = torch.tensor(temperatures, dtype=conf_logits.dtype)
    return torch.sigmoid(conf_logits / t)


def fit_sts(conf_logits: torch.Tensor, survived: torch.Tensor, is_valid: torch.Tensor,
            grid: tuple[float, ...] = DEFAULT_TEMPERATURE_GRID, num_bins: int = 20) -> list[float]:
    """Sequential Temperature Scaling: fit T_1, T_2, ... left to right.

    conf_logits (n, γ) pre-sigmoid confidences; survived (n, γ) 1 where draft token k was accepted
    (so the prefix 1..k survived); is_valid (n, γ) where position k was verified. At position k the
    temperature minimises the ECE of the cumulative product a_k = Π_{i≤k} c_i against `survived[:, k]`,
    with the already-calibrated positions < k held fixed. Temperature scaling keeps the ranking.
    """
    n, gamma = conf_logits.shape
    temps: list[float] = []
    prefix = torch.ones(n)
    for k in range(gamma):
        rows = is_valid[:, k]
        if not bool(rows.any()):
            temps.append(1.0)
            continue
        best_t, best_e = 1.0, float("inf")
        for t in grid:
            a_k = prefix[rows] * torch.sigmoid(conf_logits[rows, k] / t)
            e = ece(a_k, survived[rows, k].float(), num_bins)
            if e < best_e - 1e-12:
                best_t, best_e = t, e
        temps.append(best_t)
        prefix = prefix * torch.sigmoid(conf_logits[:, k] / best_t)
    return temps
