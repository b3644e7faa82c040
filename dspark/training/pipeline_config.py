"""The training pipeline's YAML config (pydantic: a typo is an error, not a silent default)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SynthSection(_Strict):
    num_prompts: int = Field(1024, ge=1, description="Prompts to synthesise (Magpie + stdlib).")
    num_stdlib_prompts: int = Field(160, ge=0, description="Of which derived from stdlib sources.")
    domain_mix: dict[str, float] = Field({"math": 0.4, "code": 0.25, "chat": 0.35},
                                         description="Magpie domain weights.")
    shard_size: int = Field(64, ge=1, description="Prompts per resumable shard.")
    prompt_max_tokens: int = Field(80, ge=8, description="Longest synthesised user message.")
    response_max_tokens: int = Field(256, ge=8, description="Longest response.")
    response_temperature: float = Field(0.7, ge=0, description="Response sampling temperature.")
    response_top_p: float = Field(0.9, gt=0, le=1, description="Response nucleus mass.")
    seed: int = Field(0, description="Seed for prompt planning and sampling.")


class EngineSection(_Strict):
    drafter: str = Field("ngram", description="Drafter used while generating data.")
    scheduler: str = Field("greedy", description="Scheduler used while generating data.")
    max_num_seqs: int = Field(16, ge=1, description="Concurrent sequences.")
    max_model_len: int = Field(1024, ge=64, description="Longest prompt + response.")


class ModelSection(_Strict):
    num_layers: int = Field(2, ge=1, description="Draft decoder layers.")
    block_size: int = Field(7, ge=1, description="γ: draft block size.")
    head_type: str = Field("markov", description="markov | rnn | none (DFlash).")
    markov_rank: int = Field(256, ge=1, description="Rank r of W1·W2.")
    use_confidence: bool = Field(True, description="Train the confidence head.")
    target_layers: list[int] | None = Field(None, description="Tapped target layers; null: low/mid/high.")
    draft_vocab_size: int = Field(8192, ge=16, description="N most frequent target tokens.")
    init_from_target: bool = Field(False, description="Start the draft layers from the target's top layers.")


class TrainSection(_Strict):
    num_steps: int = Field(600, ge=1, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Sequences per step.")
    num_anchors: int = Field(16, ge=1, description="Blocks per sequence.")
    lr: float = Field(6e-4, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(40, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    seed: int = Field(0, description="Training seed.")
    checkpoint_every: int = Field(50, ge=1, description="Steps between resumable checkpoints.")
    heldout_fraction: float = Field(0.06, ge=0, lt=1, description="Held out for calibration/validation.")
    max_seq_len: int = Field(768, ge=16, description="Sequences are cut here for the cache.")
    num_calibration_prompts: int = Field(48, ge=1, description="Held-out prompts decoded to fit STS.")
    calibration_max_tokens: int = Field(128, ge=8, description="Tokens per calibration prompt.")


class PipelineConfig(_Strict):
    name: str = Field(..., description="Run name.")
    target: str = Field("smollm2-135m-instruct", description="Target model.")
    work_dir: Path = Field(..., description="Where data, caches and training checkpoints go.")
    output: Path = Field(..., description="Final drafter checkpoint folder.")
    synth: SynthSection = Field(default_factory=SynthSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    model: ModelSection = Field(default_factory=ModelSection)
    train: TrainSection = Field(default_factory=TrainSection)

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineConfig:
        cfg = cls.model_validate(yaml.safe_load(Path(path).read_text()))
        cfg.work_dir = cfg.work_dir.expanduser()
        return cfg
