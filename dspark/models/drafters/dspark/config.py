"""Configuration of the DSpark draft model (parallel backbone + sequential head + confidence head)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dspark.models.drafters.target_signature import signature_of, text_config

HEAD_TYPES = ("markov", "rnn", "none")


def default_target_layers(num_target_layers: int) -> list[int]:
    """Low / mid / high HF hidden_states indices (0 = embeddings, i = after decoder layer i).

    A 30-layer target gives [2, 15, 28]; tiny targets (≤ 3 layers) tap every layer.
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    n = num_target_layers
    if n <= 3:
        return list(range(1, n + 1))
    low, high = (2, n - 2) if n >= 8 else (1, n - 1)
    return sorted({low, n // 2, high})


@dataclass
class DSparkConfig:
    """Sizes and options of a DSpark drafter for one target model.

    The draft hidden size equals the target's (`target_hidden_size`) so that the target's frozen
    embedding and LM head can be shared; the LM head is restricted to a draft vocabulary of
    `draft_vocab_size` target tokens (the map itself is a model buffer, saved with the weights).
    """

    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int  # N
    target_layers: list[int]  # HF hidden_states indices whose features are concatenated as context
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    block_size: int = 7  # γ: positions per draft block (anchor + γ-1 masks) = draft tokens per round
    head_type: str = "markov"  # "markov" | "rnn" | "none" (DFlash: no sequential head)
    markov_rank: int = 256  # r: width of W1 (and of the RNN state)
    use_confidence: bool = True
    sts_temperatures: list[float] | None = None  # one per position, divides confidence logits
    model_type: str = "dspark"
    target: dict[str, Any] | None = None  # the target it was built for (target_signature.py)

    def __post_init__(self) -> None:
        self.target_layers = [int(i) for i in self.target_layers]
        if self.sts_temperatures is not None:
            self.sts_temperatures = [float(t) for t in self.sts_temperatures]
        self.validate()

    @property
    def hidden_size(self) -> int:
        """The draft model's width (the target's, so embedding and LM head are shared)."""
        return self.target_hidden_size

    @property
    def num_context_features(self) -> int:
        """Width of one context row: the tapped target layers concatenated."""
        return len(self.target_layers) * self.target_hidden_size

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        positive = ("target_hidden_size", "target_vocab_size", "draft_vocab_size", "num_heads", "num_kv_heads",
                    "head_dim", "intermediate_size", "num_layers", "block_size", "markov_rank")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DSparkConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds target_vocab_size "
                             f"({self.target_vocab_size})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.target_layers:
            raise ValueError("target_layers must name at least one target layer")
        if min(self.target_layers) < 0:
            raise ValueError(f"target_layers must be >= 0 (0 = embeddings), got {self.target_layers}")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {HEAD_TYPES}, got {self.head_type!r}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.sts_temperatures is not None:
            if len(self.sts_temperatures) != self.block_size:
                raise ValueError(f"sts_temperatures needs one entry per block position ({self.block_size}), "
                                 f"got {len(self.sts_temperatures)}")
            if min(self.sts_temperatures) <= 0:
                raise ValueError(f"sts_temperatures must be positive, got {self.sts_temperatures}")
        if self.model_type != "dspark":
            raise ValueError(f"model_type must be 'dspark', got {self.model_type!r}")

    # ---- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DSparkConfig:
        """Build from a dict; unknown keys are an error (a typo must not silently fall back to a default)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DSparkConfig keys: {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DSparkConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, **overrides: Any) -> DSparkConfig:
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
            target_layers=default_target_layers(cfg.num_hidden_layers),
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
