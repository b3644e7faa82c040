"""Tiny random baseline drafters (DFlash, EAGLE-3, MTP-1) for the tiny target of tests/tiny.py."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.models.drafters.ar.eagle3 import Eagle3Model
from dspark.models.drafters.ar.eagle3_config import Eagle3Config
from dspark.models.drafters.ar.model import ARDraftModel
from dspark.models.drafters.ar.mtp import MTPModel
from dspark.models.drafters.ar.mtp_config import MTPConfig
from dspark.models.drafters.dspark.config import DSparkConfig
from dspark.models.drafters.dspark.model import DSparkModel
from dspark.models.target.loader import TargetModel

NUM_DRAFT_VOCAB = 40
GAMMA = 5
BASELINE_NAMES = ("dflash", "eagle3", "mtp1")


def draft_vocab(vocab: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:NUM_DRAFT_VOCAB]


def make_ar(target: TargetModel, kind: str, seed: int = 0) -> ARDraftModel:
    """A random EAGLE-3 (taps 1, 2, 3) or MTP-1 (last layer) drafter attached to the tiny target.

    Weights are larger than the training init (std 0.3), so every input visibly moves the logits.
    """
    torch.manual_seed(seed)
    hf_cfg = target.model.config
    if kind == "eagle3":
        cfg = Eagle3Config.from_target(hf_cfg, NUM_DRAFT_VOCAB, [1, 2, 3], block_size=GAMMA, intermediate_size=96)
        model: ARDraftModel = Eagle3Model(cfg, draft_vocab(hf_cfg.vocab_size))
    elif kind == "mtp1":
        cfg = MTPConfig.from_target(hf_cfg, NUM_DRAFT_VOCAB, [hf_cfg.num_hidden_layers], intermediate_size=96)
        model = MTPModel(cfg, draft_vocab(hf_cfg.vocab_size))
    else:
        raise ValueError(f"not an autoregressive drafter: {kind!r}")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.3)
    model.attach_target(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    return model.eval()


def make_dflash(target: TargetModel, seed: int = 0) -> DSparkModel:
    """A random one-layer DFlash drafter: the DSpark backbone, no sequential or confidence head."""
    torch.manual_seed(seed)
    hf_cfg = target.model.config
    cfg = DSparkConfig.from_target(hf_cfg, NUM_DRAFT_VOCAB, intermediate_size=96, block_size=GAMMA,
                                   head_type="none", use_confidence=False, num_layers=1)
    model = DSparkModel(cfg, draft_vocab(hf_cfg.vocab_size))
    model.attach_target(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    return model.eval()


def make_dspark(target: TargetModel, seed: int = 0) -> DSparkModel:
    """A random one-layer DSpark drafter with its Markov head and confidence head."""
    torch.manual_seed(seed)
    hf_cfg = target.model.config
    cfg = DSparkConfig.from_target(hf_cfg, NUM_DRAFT_VOCAB, intermediate_size=96, block_size=GAMMA,
                                   head_type="markov", markov_rank=16, use_confidence=True, num_layers=1)
    model = DSparkModel(cfg, draft_vocab(hf_cfg.vocab_size))
    model.attach_target(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    return model.eval()


def save_tiny_baseline(target: TargetModel, kind: str, out: Path) -> Path:
    """Write a random `kind` (dflash, dspark, eagle3, mtp1) checkpoint folder that
    `make_drafter(kind, target, path=out)` loads."""
    model = {"dflash": make_dflash, "dspark": make_dspark}.get(kind, lambda t: make_ar(t, kind))(target)
    model.save_pretrained(out)
    return out
