"""The training pipeline's YAML config (pydantic: a typo is an error, not a silent default)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

# drafter kinds the pipeline trains, and the objective each trains with unless `train.loss` says otherwise
TRAINABLE_DRAFTERS = ("dspark", "dflash", "eagle3", "mtp1")
DEFAULT_LOSS = {"dspark": "dspark", "dflash": "ce", "eagle3": "kl", "mtp1": "kl"}
LOSS_NAMES = ("dspark", "ce", "tv", "kl")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SynthSection(_Strict):
    num_prompts: int = Field(1024, ge=1, description="Prompts to synthesise (Magpie + stdlib).")
    num_stdlib_prompts: int = Field(160, ge=0, description="Of which derived from stdlib sources.")
    num_doc_prompts: int = Field(0, ge=0, description="Of which from man pages and Python's docs.")
    domain_mix: dict[str, float] = Field({"math": 0.4, "code": 0.25, "chat": 0.35},
                                         description="Magpie domain weights.")
    shard_size: int = Field(512, ge=1, description="Prompts per resumable shard (one refilled batch).")
    prompt_max_tokens: int = Field(80, ge=8, description="Longest synthesised user message.")
    response_max_tokens: int = Field(256, ge=8, description="Longest response.")
    response_temperature: float = Field(0.7, ge=0, description="Response sampling temperature.")
    response_top_p: float = Field(0.9, gt=0, le=1, description="Response nucleus mass.")
    greedy_fraction: float = Field(0.0, ge=0, le=1, description="Share of responses generated at T = 0.")
    seed: int = Field(0, description="Seed for prompt planning and sampling.")
    data_dir: Path | None = Field(None, description="Where the shards go (relative paths: to the repo root), "
                                  "e.g. a committed data folder; default: <work_dir>/data.")
    max_wall_s: float | None = Field(None, gt=0, description="Stop synthesising after the shard that "
                                     "crosses this many seconds (resume later); None: run to the end.")


class EngineSection(_Strict):
    drafter: str = Field("ngram", description="Drafter used while generating data.")
    scheduler: str = Field("greedy", description="Scheduler used while generating data.")
    max_num_seqs: int = Field(16, ge=1, description="Concurrent sequences.")
    dtype: str = Field("auto", description="fp32 | bf16 | auto (the fastest for offline generation, measured "
                       "on this machine).")
    max_model_len: int = Field(1024, ge=64, description="Longest prompt + response.")


class ModelSection(_Strict):
    num_layers: int = Field(2, ge=1, description="Draft decoder layers (dspark, dflash; EAGLE-3 and MTP-1 have 1).")
    block_size: int = Field(7, ge=1, description="γ: draft block size (EAGLE-3: training-time-test steps; "
                            "MTP-1: must be 1).")
    head_type: str = Field("markov", description="markov | rnn | none (DFlash).")
    markov_rank: int = Field(256, ge=1, description="Rank r of W1·W2.")
    use_confidence: bool = Field(True, description="Train the confidence head.")
    target_layers: list[int] | None = Field(None, description="Tapped target layers (cached; the drafter's "
                                            "features, except MTP-1's: the last layer); null: low/mid/high.")
    draft_vocab_size: int = Field(8192, ge=16, description="N most frequent target tokens.")
    init_from_target: bool = Field(False, description="Start the draft layers from the target's top layers.")
    init_checkpoint: Path | None = Field(None, description="Start from this trained checkpoint folder of the "
                                         "same drafter kind and shape (continued training with a fresh warm-up "
                                         "and decay; overrides init_from_target).")


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
    loss: str | None = Field(None, description="Objective: dspark (0.1 CE + 0.9 TV + BCE) | ce (DFlash) | tv "
                             "(0.1 CE + 0.9 TV) | kl (EAGLE-3); null: the drafter's own.")
    heldout_fraction: float = Field(0.06, ge=0, lt=1, description="Held out for calibration/validation.")
    max_seq_len: int = Field(768, ge=16, description="Sequences are cut here for the cache.")
    feature_dtype: str = Field("fp32", description="dtype of the target that computes the cached features: "
                               "fp32 | bf16 | auto (the fastest for batched prefill on this machine, measured).")
    features: Literal["auto", "cache", "online"] = Field(
        "auto", description="Where the target features come from: cache (build the target cache once, train "
                            "from it: cheapest when several drafters share it), online (the target runs on "
                            "each batch; nothing stored) or auto (the cache when a complete one is on disk, "
                            "else online; never builds one).")
    resident_shards: int = Field(64, ge=1, description="Cache shards held in memory at once (a sliding "
                                 "window over a cache larger than RAM).")
    steps_per_shard: int = Field(4, ge=1, description="Steps between window moves (one shard in, one out).")
    num_calibration_prompts: int = Field(48, ge=1, description="Held-out prompts decoded to fit STS.")
    calibration_max_tokens: int = Field(128, ge=8, description="Tokens per calibration prompt.")


class PipelineConfig(_Strict):
    name: str = Field(..., description="Run name.")
    target: str = Field("smollm2-135m-instruct", description="Target model.")
    drafter: str = Field("dspark", description="What the train stage trains: dspark | dflash | eagle3 | mtp1.")
    work_dir: Path = Field(..., description="Where data, caches and training checkpoints go; runs of other "
                           "drafters sharing it reuse its data, vocab and cache and train under runs/<name>.")
    output: Path = Field(..., description="Final drafter checkpoint folder.")
    synth: SynthSection = Field(default_factory=SynthSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    model: ModelSection = Field(default_factory=ModelSection)
    train: TrainSection = Field(default_factory=TrainSection)

    @model_validator(mode="after")
    def _check_drafter(self) -> PipelineConfig:
        if self.drafter not in TRAINABLE_DRAFTERS:
            raise ValueError(f"drafter must be one of {TRAINABLE_DRAFTERS}, got {self.drafter!r}")
        if self.train.loss is not None and self.train.loss not in LOSS_NAMES:
            raise ValueError(f"train.loss must be one of {LOSS_NAMES}, got {self.train.loss!r}")
        if self.drafter == "dflash" and (self.model.head_type != "none" or self.model.use_confidence):
            raise ValueError("dflash is the DSpark backbone without sequential or confidence head: set "
                             "model.head_type: none and model.use_confidence: false")
        if self.drafter == "mtp1" and self.model.block_size != 1:
            raise ValueError("mtp1 drafts one token per round: set model.block_size: 1")
        return self

    @property
    def loss(self) -> str:
        """The training objective's name: `train.loss`, else the drafter's own."""
        return self.train.loss or DEFAULT_LOSS[self.drafter]

    @property
    def run_dir(self) -> Path:
        """Where this run's training state, trained weights and calibration go: runs sharing a work_dir (the
        drafter comparison, the ablations) share its data, vocab and cache and keep their own weights here."""
        return self.work_dir / "runs" / self.name

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineConfig:
        cfg = cls.model_validate(yaml.safe_load(Path(path).read_text()))
        cfg.work_dir = cfg.work_dir.expanduser()
        cfg.output = cfg.output.expanduser()
        return cfg
