"""The MTP-1 baseline drafter: a DeepSeek-V3-style multi-token-prediction module.

input_t = W [RMSNorm(emb(x_{t+1})) ; RMSNorm(h_t)] (2D -> D), with h_t the target's final hidden state
at position t; one causal transformer block over the positions; the target's frozen LM head predicts
x_{t+2}. One draft token per round (`MTPConfig.block_size` = 1). Everything lives in `ARDraftModel`;
the feature is the final hidden state as is.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from dspark.models.drafters.ar.config import ARDraftConfig
from dspark.models.drafters.ar.model import ARDraftModel
from dspark.models.drafters.ar.mtp_config import MTPConfig


class MTPModel(ARDraftModel):
    """MTP-1 drafter; call `attach_target` before any forward."""

    config_class: ClassVar[type[ARDraftConfig]] = MTPConfig

    def encode_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target final hidden state (..., D) -> itself (RMSNorm'd by `feature_norm` in the input)."""
        return features.to(self.in_proj.weight.dtype)
