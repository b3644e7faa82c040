"""Drafter training objectives: DSpark's (paper §3.3, eq. 9-12: position-weighted CE + TV + confidence BCE)
and the baselines' (DFlash: CE only; EAGLE-3 / MTP-1: KL to the target), as weights of one set of terms.

The draft distribution p_d lives on the draft vocabulary (N tokens, zero elsewhere); the target
distribution p_t is given restricted to the same N tokens, its remaining mass 1 − Σ p_t lying outside.
So the L1 distance over the FULL target vocabulary is exact without materialising V_t columns:
    ‖p_d − p_t‖₁ = Σ_{v ∈ draft vocab} |p_d(v) − p_t(v)| + (1 − Σ_{v ∈ draft vocab} p_t(v)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.models.drafters.dspark.model import DSparkTrainOutput


@dataclass
class LossWeights:
    """α weights of eq. 12 (paper defaults), plus a KL(p_t ‖ p_d) term the DSpark objective does not use."""

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    kl: float = 0.0


# Named objectives (`train.loss` in the pipeline YAML); every term keeps the exp(−(k−1)/γ) position weights.
LOSS_PRESETS: dict[str, LossWeights] = {
    "dspark": LossWeights(),  # 0.1·CE + 0.9·TV + 1.0·BCE(conf)
    "ce": LossWeights(ce=1.0, tv=0.0, conf=0.0),  # DFlash: CE on the ground-truth token only
    "tv": LossWeights(ce=0.1, tv=0.9, conf=0.0),  # DSpark's distillation without a confidence head
    "kl": LossWeights(ce=0.0, tv=0.0, conf=0.0, kl=1.0),  # EAGLE-3: forward KL to the target distribution
}


def loss_weights(name: str) -> LossWeights:
    """The weights of a named objective (one of LOSS_PRESETS)."""
    if name not in LOSS_PRESETS:
        raise ValueError(f"unknown loss {name!r}; expected one of {', '.join(LOSS_PRESETS)}")
    return LOSS_PRESETS[name]


@dataclass
class DSparkLoss:
    """The total objective and its terms (scalars; each a weighted mean over valid positions)."""

    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor  # position-weighted mean of ‖p_d − p_t‖₁ (in [0, 2])
    conf: torch.Tensor
    kl: torch.Tensor  # position-weighted mean of Σ_{v ∈ draft vocab} p_t(v) log(p_t(v) / p_d(v))
    acceptance_per_position: torch.Tensor  # (γ,) mean soft label c*_k over valid positions (detached)
    num_valid: torch.Tensor  # () long; a tensor so the training step needs no host sync


def position_weights(block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ) for k = 1..γ, shape (γ,)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.exp(-k / block_size)


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w·x / Σ w over positions with w > 0; 0 (with a graph) when nothing is valid."""
    return (values * weights).sum() / weights.sum().clamp_min(1e-12)


def dspark_loss(out: DSparkTrainOutput, target_probs: torch.Tensor,
                weights: LossWeights | None = None) -> DSparkLoss:
    """Eq. 9-12 (with `weights`) on the teacher-forced outputs of a drafter's `forward_train`.

    target_probs (B, M, γ, N): p_t restricted to the draft vocabulary (each row sums to ≤ 1; the rest of
    the target's mass is outside the draft vocabulary, where p_d is 0). CE skips positions whose
    ground-truth token is outside the draft vocabulary; every term is masked by `out.is_valid`. KL is over
    the draft vocabulary: the target's mass outside it adds a constant that p_d cannot change.
    """
    w = weights or LossWeights()
    logits = out.logits.float()
    gamma = logits.shape[-2]
    pos_w = position_weights(gamma, logits.device)  # (γ,)
    valid_w = out.is_valid.float() * pos_w  # (B, M, γ)

    log_pd = torch.log_softmax(logits, dim=-1)  # (B, M, γ, N)
    nll = -log_pd.gather(-1, out.draft_labels.unsqueeze(-1)).squeeze(-1)  # (B, M, γ)
    ce = _weighted_mean(nll, valid_w * out.is_label_in_draft_vocab.float())

    p_t = target_probs.to(logits.dtype)
    outside_mass = (1.0 - p_t.sum(dim=-1)).clamp_min(0.0)  # target mass the drafter can never place
    l1 = (log_pd.exp() - p_t).abs().sum(dim=-1) + outside_mass  # (B, M, γ) ‖p_d − p_t‖₁ over V_t
    tv = _weighted_mean(l1, valid_w)
    kl_rows = (torch.xlogy(p_t, p_t) - p_t * log_pd).sum(dim=-1)  # (B, M, γ)
    kl = _weighted_mean(kl_rows, valid_w)

    soft_label = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # c*_k, eq. 8
    if out.confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(out.confidence_logits.float(), soft_label, reduction="none")
        conf = _weighted_mean(bce, valid_w)
    else:
        conf = logits.new_zeros(())
    total = w.ce * ce + w.tv * tv + w.conf * conf + w.kl * kl

    is_valid = out.is_valid.float()
    per_pos = (soft_label * is_valid).flatten(0, -2).sum(0) / is_valid.flatten(0, -2).sum(0).clamp_min(1.0)
    return DSparkLoss(total=total, ce=ce.detach(), tv=tv.detach(), conf=conf.detach(),
                      kl=kl.detach(), acceptance_per_position=per_pos.detach(), num_valid=out.is_valid.sum())
