"""`dspark train-sanity`: can the drafter overfit a handful of prompts? (τ > 4 at T = 0 expected.)

If a drafter cannot memorise 50 sequences, more data will not help: the features, labels and positions
are misaligned somewhere. The check regenerates the prompts' responses greedily with the very target the
evaluation decodes with (so training text and evaluation text are the same sequences), caches their
features, trains the configured drafter on them alone, then runs real speculative decoding (fixed block,
T = 0) on the same prompts and reports τ and the position-wise acceptance.
"""

from __future__ import annotations

import json
import shutil
import time

import torch

from dspark.config.engine import EngineConfig
from dspark.models.drafters.dspark.drafter import DSparkDrafter
from dspark.training.batches import SequencePool
from dspark.training.evaluate import run_rounds
from dspark.training.losses import loss_weights
from dspark.training.pipeline import _layers, _target, build_model, split_records, stage_vocab
from dspark.training.pipeline_config import PipelineConfig
from dspark.training.target_cache import CachedShard, build_cache
from dspark.training.trainer import TrainConfig, train
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams


def run_sanity(cfg: PipelineConfig, num_prompts: int = 50, num_steps: int = 600, max_new_tokens: int = 128,
               lr: float = 1e-3, num_anchors: int = 32, fresh: bool = False) -> dict:
    if cfg.drafter not in ("dspark", "dflash"):
        raise ValueError("the sanity check trains block drafters (dspark, dflash)")
    t0 = time.perf_counter()
    root = cfg.work_dir / "sanity" / cfg.name
    if fresh and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    stage_vocab(cfg)
    target = _target(cfg)
    train_records, _ = split_records(cfg)
    prompts = [r["prompt_ids"] for r in train_records[:num_prompts]]
    gen = Engine(EngineConfig(target=cfg.target, drafter="none", scheduler="fixed", max_num_seqs=num_prompts,
                              max_model_len=1024), target=target)
    greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    outs = gen.generate(prompts, greedy)
    records = [{"prompt_ids": p, "response_ids": o.output_ids} for p, o in zip(prompts, outs)]
    cache_dir = root / "cache"
    build_cache(target, records, _layers(cfg), cache_dir, max_len=cfg.train.max_seq_len)
    shards = [CachedShard.load(p) for p in sorted(cache_dir.glob("cache-*.safetensors"))]
    pool = SequencePool(shards)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    tcfg = TrainConfig(num_steps=num_steps, batch_size=cfg.train.batch_size, num_anchors=num_anchors, lr=lr,
                       warmup_steps=min(40, num_steps // 10), weight_decay=0.0, seed=cfg.train.seed,
                       checkpoint_every=100, loss_weights=loss_weights(cfg.loss))
    report = train(model, pool, target.model.model.norm.weight.detach(), target.model.config.rms_norm_eps, tcfg,
                   root / "train_state.pt")
    model.save_pretrained(root / "trained")
    drafter = DSparkDrafter.from_pretrained(root / "trained", target)
    gamma = model.config.block_size
    engine = Engine(EngineConfig(target=cfg.target, drafter="custom", scheduler="fixed",
                                 scheduler_kwargs={"k": gamma}, num_draft_tokens=gamma, max_num_seqs=8,
                                 max_model_len=1024, draft_gate=False), target=target, drafter=drafter)
    rounds = run_rounds(engine, prompts, 0.0, max_new_tokens, cfg.train.seed, 8)
    result = {"check": "overfit", "drafter": cfg.drafter, "num_prompts": len(prompts), "num_steps": num_steps,
              "lr": lr, "num_anchors": num_anchors, "gamma": gamma, "tau_T0": round(rounds.tau, 3),
              "passes": rounds.tau > 4.0, "conditional_acceptance": rounds.conditional_acceptance(gamma),
              "final_train": report["final"], "wall_s": round(time.perf_counter() - t0, 1)}
    (root / "sanity.json").write_text(json.dumps(result, indent=1))
    return result
