"""Configuration shared by the autoregressive feature drafters (EAGLE-3, MTP-1): one decoder layer on
[token embedding ; target feature], the target's frozen embedding and LM head over a draft vocabulary."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from dspark.models.drafters.target_signature import signature_of, text_config


@dataclass
class ARDraftConfig:
    """Sizes of a one-layer autoregressive drafter for one target model.

    The drafter's width is the target's (`target_hidden_size`), so the target's frozen embedding and
    LM head are shared; the LM head is restricted to `draft_vocab_size` target tokens (the map is a
    model buffer, saved with the weights). `block_size` is the most draft tokens per round.
    """

    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int  # N
    target_layers: list[int]  # HF hidden_states indices the drafter is conditioned on
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int = 7
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    model_type: str = ""
    target: dict[str, Any] | None = None  # the target it was built for (target_signature.py)

    MODEL_TYPE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.target_layers = [int(i) for i in self.target_layers]
        if not self.model_type:
            self.model_type = self.MODEL_TYPE
        self.validate()

    @property
    def hidden_size(self) -> int:
        """The drafter's width (the target's, so embedding and LM head are shared)."""
        return self.target_hidden_size

    @property
    def num_context_features(self) -> int:
        """Width of one observed feature row: the tapped target layers concatenated."""
        return len(self.target_layers) * self.target_hidden_size

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        name = type(self).__name__
        positive = ("target_hidden_size", "target_vocab_size", "draft_vocab_size", "num_heads", "num_kv_heads",
                    "head_dim", "intermediate_size", "block_size")
        for field_name in positive:
            if int(getattr(self, field_name)) < 1:
                raise ValueError(f"{name}.{field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds target_vocab_size "
                             f"({self.target_vocab_size})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.target_layers or min(self.target_layers) < 0:
            raise ValueError(f"target_layers must name target layers >= 0, got {self.target_layers}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.model_type != self.MODEL_TYPE:
            raise ValueError(f"model_type must be {self.MODEL_TYPE!r}, got {self.model_type!r}")

    # ---- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Build from a dict; unknown keys are an error (a typo must not silently fall back to a default)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys: {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Self:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, target_layers: list[int],
                    **overrides: Any) -> Self:
        """Copy sizes from a HF decoder config of any family (hidden, heads, MLP width, RoPE) and record the
        target's signature (loading refuses another target); overrides win."""
        cfg = text_config(target_config)  # a multimodal wrapper's decoder
        num_heads = cfg.num_attention_heads
        rope_theta = getattr(cfg, "rope_theta", None)
        if rope_theta is None:  # transformers 5 keeps it in rope_parameters
            rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        values: dict[str, Any] = dict(
            target_hidden_size=cfg.hidden_size,
            target_vocab_size=cfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_layers=list(target_layers),
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            target=signature_of(target_config),
        )
        values.update(overrides)
        return cls.from_dict(values)
