"""Configuration of the EAGLE-3 baseline drafter (autoregressive, one layer, fused low/mid/high features)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dspark.models.drafters.ar.config import ARDraftConfig


@dataclass
class Eagle3Config(ARDraftConfig):
    """EAGLE-3: `target_layers` (low/mid/high) are concatenated and fused by a linear layer; the
    training-time test is unrolled to `block_size` steps, the same horizon as a DSpark block."""

    MODEL_TYPE: ClassVar[str] = "eagle3"
