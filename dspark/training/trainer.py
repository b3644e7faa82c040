"""Drafter trainer: AdamW, warm-up + cosine decay, clipping, resumable checkpoints, progress bar."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.models.drafters.ar.model import ARDraftModel
from dspark.models.drafters.dspark.model import DSparkModel
from dspark.training.batches import SequenceSource, TrainBatch, make_batch, target_probs_over_draft_vocab
from dspark.training.losses import LossWeights, dspark_loss


@dataclass
class TrainConfig:
    num_steps: int = 600
    batch_size: int = 8  # sequences per step
    num_anchors: int = 16  # blocks per sequence
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    loss_weights: LossWeights | None = None


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: DSparkModel | ARDraftModel, pool: SequenceSource, final_norm: torch.Tensor, eps: float,
          cfg: TrainConfig, ckpt_path: Path, features_of: Callable[[TrainBatch], torch.Tensor] | None = None) -> dict:
    """Train in place; resumes from ckpt_path (model, optimizer, step, RNG) when it exists.

    `features_of` picks the features the model is conditioned on from a batch (default: the cached taps).
    """
    torch.manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, history = 0, []
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        rng.setstate(state["py_rng"])
        gen.set_state(state["torch_rng"])
    gamma = model.config.block_size
    bar = tqdm(total=cfg.num_steps, initial=step, desc="train", unit="step")
    t0, blocks = time.perf_counter(), 0
    model.train()
    while step < cfg.num_steps:
        batch = make_batch(pool, pool.sample(rng, cfg.batch_size, step), cfg.num_anchors, gamma, gen)
        with torch.no_grad():
            p_t = target_probs_over_draft_vocab(batch, gamma, final_norm, eps, model.draft_lm_head)
        features = batch.features if features_of is None else features_of(batch)
        out = model.forward_train(features, batch.token_ids, batch.anchors, batch.seq_lens,
                                  batch.is_anchor_valid)
        loss = dspark_loss(out, p_t, cfg.loss_weights)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        blocks += int(batch.is_anchor_valid.sum())
        rec = {"step": step, "loss": loss.total.item(), "ce": loss.ce.item(), "tv": loss.tv.item(),
               "conf": loss.conf.item(), "kl": loss.kl.item(), "grad_norm": float(grad_norm),
               "lr": lr_at(step - 1, cfg),
               "acceptance": [round(a, 4) for a in loss.acceptance_per_position.tolist()]}
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", tv=f"{rec['tv']:.3f}", acc1=rec["acceptance"][0],
                        blocks_s=f"{blocks / (time.perf_counter() - t0):.1f}")
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == cfg.num_steps:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "history": history, "py_rng": rng.getstate(), "torch_rng": gen.get_state(),
                        "config": json.dumps(asdict(cfg), default=str)}, tmp)
            tmp.replace(ckpt_path)
    bar.close()
    model.eval()
    return {"num_steps": step, "final": history[-1] if history else None,
            "wall_s_this_run": time.perf_counter() - t0}
