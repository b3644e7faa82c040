"""The EAGLE-3 baseline drafter: fused low/mid/high target features, one autoregressive decoder layer.

The tapped target layers of a position, concatenated, go through one linear layer (`fc`, taps·D -> D):
that is the feature of the first draft step; later steps feed back the layer's own output instead
(training-time test). Everything else lives in `ARDraftModel`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from dspark.models.drafters.ar.config import ARDraftConfig
from dspark.models.drafters.ar.eagle3_config import Eagle3Config
from dspark.models.drafters.ar.model import ARDraftModel
from dspark.models.drafters.draft_gemm import Sources, same


class Eagle3Model(ARDraftModel):
    """EAGLE-3 drafter; call `attach_target` before any forward."""

    config_class: ClassVar[type[ARDraftConfig]] = Eagle3Config

    def _build_feature_encoder(self) -> None:
        self.fc = nn.Linear(self.config.num_context_features, self.config.hidden_size, bias=False)

    def encode_features(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated low/mid/high features (..., taps*D_t) -> fused feature (..., D)."""
        return self._linear("fc", features.to(self.fc.weight.dtype), self.fc.weight)

    def _feature_encoder_sources(self) -> Sources:
        return {"fc": (lambda: self.fc.weight, same)}

    @torch.no_grad()
    def _init_feature_encoder_from_target(self) -> None:
        # like DSpark's fc: pass the highest tapped layer through, small weights on the others
        d = self.config.hidden_size
        self.fc.weight.mul_(0.1)
        self.fc.weight[:, -d:] += torch.eye(d, dtype=self.fc.weight.dtype)
