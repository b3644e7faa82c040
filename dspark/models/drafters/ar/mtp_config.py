"""Configuration of the MTP-1 baseline drafter (DeepSeek-V3-style multi-token-prediction module)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dspark.models.drafters.ar.config import ARDraftConfig


@dataclass
class MTPConfig(ARDraftConfig):
    """MTP-1: conditioned on the target's final hidden state only (`target_layers` = [num_target_layers]),
    drafts exactly one token per round (`block_size` = 1)."""

    block_size: int = 1
    MODEL_TYPE: ClassVar[str] = "mtp1"

    def validate(self) -> None:
        super().validate()
        if self.block_size != 1:
            raise ValueError(f"MTP-1 drafts exactly one token per round: block_size must be 1, got {self.block_size}")
        if len(self.target_layers) != 1:
            raise ValueError(f"MTP-1 reads one target layer (the last), got target_layers={self.target_layers}")
