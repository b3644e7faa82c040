"""`dspark train --config ...`: synth → vocab → cache → train → calibrate → export, each stage skipped when
its output exists. synth, vocab and cache are shared by every drafter kind trained in one work_dir; the train
stage builds the kind named by `drafter` (dspark, dflash, eagle3, mtp1). With `train.features` online (or auto
and no cache on disk) there is no cache: the train stage runs the target on each batch."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from dspark.models.drafters.ar.eagle3 import Eagle3Model
from dspark.models.drafters.ar.eagle3_config import Eagle3Config
from dspark.models.drafters.ar.model import ARDraftModel
from dspark.models.drafters.ar.mtp import MTPModel
from dspark.models.drafters.ar.mtp_config import MTPConfig
from dspark.models.drafters.dspark.config import DSparkConfig, default_target_layers
from dspark.models.drafters.dspark.model import DSparkModel
from dspark.models.target.loader import TargetModel, load_target
from dspark.training.batches import SequenceSource, TrainBatch, select_features
from dspark.training.losses import loss_weights
from dspark.training.online_pool import OnlinePool
from dspark.training.pipeline_config import PipelineConfig
from dspark.training.shard_window import ShardWindowPool
from dspark.training.synth import SynthConfig, load_records, run_synthesis
from dspark.training.target_cache import build_cache
from dspark.training.trainer import TrainConfig, train
from dspark.training.vocab import build_draft_vocab, coverage_table, token_counts

log = logging.getLogger(__name__)

STAGES = ("synth", "vocab", "cache", "train", "calibrate", "export")


REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir(cfg: PipelineConfig) -> Path:
    if cfg.synth.data_dir is None:
        return cfg.work_dir / "data"
    return cfg.synth.data_dir if cfg.synth.data_dir.is_absolute() else REPO_ROOT / cfg.synth.data_dir


def stage_synth(cfg: PipelineConfig) -> dict:
    from dspark.config.engine import EngineConfig
    from dspark.verify_service.engine import Engine

    out = data_dir(cfg)
    done = out / "DONE.json"
    if done.exists():
        return {"skipped": True, **json.loads(done.read_text())}
    e = cfg.engine
    s = cfg.synth
    engine = Engine(EngineConfig(target=cfg.target, drafter=e.drafter, scheduler=e.scheduler, dtype=e.dtype,
                                 dtype_role="generate", max_num_seqs=e.max_num_seqs,
                                 max_model_len=e.max_model_len, draft_gate=False))
    report = run_synthesis(engine, SynthConfig(
        num_prompts=s.num_prompts, num_stdlib_prompts=s.num_stdlib_prompts, num_doc_prompts=s.num_doc_prompts,
        domain_mix=dict(s.domain_mix), shard_size=s.shard_size, prompt_max_tokens=s.prompt_max_tokens,
        response_max_tokens=s.response_max_tokens, response_temperature=s.response_temperature,
        response_top_p=s.response_top_p, greedy_fraction=s.greedy_fraction, seed=s.seed), out, s.max_wall_s)
    report["dtype"] = str(engine.target.dtype).removeprefix("torch.")
    if report["is_complete"]:
        done.write_text(json.dumps({**report, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    return report


def split_records(cfg: PipelineConfig) -> tuple[list[dict], list[dict]]:
    """Deduplicated records split into (train, held-out) by a stable hash of the prompt."""
    records = load_records(data_dir(cfg))
    if not records:
        raise FileNotFoundError(f"no synthesized data under {data_dir(cfg)}: run the synth stage")
    cut = int(cfg.train.heldout_fraction * 10_000)
    held = [r for r in records if _bucket(r["prompt"]) < cut]
    train = [r for r in records if _bucket(r["prompt"]) >= cut]
    return train, held


def _bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 10_000


def stage_vocab(cfg: PipelineConfig) -> dict:
    path = cfg.work_dir / "vocab.json"
    if path.exists():
        return {"skipped": True, **{k: v for k, v in json.loads(path.read_text()).items() if k != "draft_to_target"}}
    train, _ = split_records(cfg)
    counts = token_counts(train)
    eos = _target(cfg).eos_token_ids
    vocab = build_draft_vocab(counts, cfg.model.draft_vocab_size, eos)
    path.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone: the committed data, no work_dir yet
    info = {"coverage": coverage_table(counts), "num_distinct": len(counts), "num_tokens": sum(counts.values()),
            "draft_vocab_size": len(vocab)}
    path.write_text(json.dumps({**info, "draft_to_target": vocab}))
    return info


def cache_is_complete(cfg: PipelineConfig) -> bool:
    return all((cfg.work_dir / "cache" / part / "meta.json").exists() for part in ("train", "heldout"))


def features_online(cfg: PipelineConfig) -> bool:
    """Whether training computes the target features per batch (see `train.features`)."""
    return cfg.train.features == "online" or (cfg.train.features == "auto" and not cache_is_complete(cfg))


def stage_cache(cfg: PipelineConfig) -> dict:
    if features_online(cfg):
        return {"skipped": True, "reason": f"features: {cfg.train.features}: computed online while training"}
    if cache_is_complete(cfg):
        return {"skipped": True, **json.loads((cfg.work_dir / "cache" / "train" / "meta.json").read_text())}
    train, held = split_records(cfg)
    layers = _layers(cfg)
    target, dtype = _feature_target(cfg)
    out = {"train": build_cache(target, train, layers, cfg.work_dir / "cache" / "train",
                                max_len=cfg.train.max_seq_len),
           "heldout": build_cache(target, held, layers, cfg.work_dir / "cache" / "heldout",
                                  max_len=cfg.train.max_seq_len), "feature_dtype": dtype}
    return out


def build_model(cfg: PipelineConfig) -> DSparkModel | ARDraftModel:
    """The untrained drafter of kind `cfg.drafter`, on the shared draft vocabulary, attached to the target."""
    target = _target(cfg)
    vocab = json.loads((cfg.work_dir / "vocab.json").read_text())["draft_to_target"]
    m, hf_cfg = cfg.model, target.model.config
    model: DSparkModel | ARDraftModel
    if cfg.drafter in ("dspark", "dflash"):  # DFlash: the same backbone, no heads (checked by the config)
        dcfg = DSparkConfig.from_target(hf_cfg, draft_vocab_size=len(vocab), num_layers=m.num_layers,
                                        block_size=m.block_size, head_type=m.head_type, markov_rank=m.markov_rank,
                                        use_confidence=m.use_confidence, target_layers=_layers(cfg))
        model = DSparkModel(dcfg, torch.tensor(vocab))
    elif cfg.drafter == "eagle3":
        model = Eagle3Model(Eagle3Config.from_target(hf_cfg, len(vocab), _layers(cfg), block_size=m.block_size),
                            torch.tensor(vocab))
    else:  # mtp1: conditioned on the target's last layer
        model = MTPModel(MTPConfig.from_target(hf_cfg, len(vocab), [hf_cfg.num_hidden_layers]), torch.tensor(vocab))
    if m.init_checkpoint is not None:
        model.load_state_dict(_checkpoint_weights(m.init_checkpoint.expanduser(), model))
        log.info("drafter initialised from %s", m.init_checkpoint)
    elif m.init_from_target:
        log.info("draft layers initialised from target layers %s", model.init_from_target(target.model))
    model.attach_target(target.model.get_input_embeddings().weight.detach(),
                        target.model.get_output_embeddings().weight.detach())
    return model


def _checkpoint_weights(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's weights for `model`, checked for kind and shape (its config must match this run's)."""
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    own = model.state_dict()
    wrong = sorted(set(weights) ^ set(own)) + [k for k in weights if k in own and weights[k].shape != own[k].shape]
    if wrong:
        raise ValueError(f"model.init_checkpoint {path} does not fit this run's drafter: {wrong[:5]}")
    return weights


def stage_train(cfg: PipelineConfig) -> dict:
    final = cfg.run_dir / "trained"
    if (final / "config.json").exists():
        return {"skipped": True}
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    t = cfg.train
    pool: SequenceSource
    if features_online(cfg):
        pool = OnlinePool(split_records(cfg)[0], _feature_target(cfg)[0], _layers(cfg), t.max_seq_len)
        cache_layers = _layers(cfg)
    else:
        pool = ShardWindowPool(sorted((cfg.work_dir / "cache" / "train").glob("cache-*.safetensors")),
                               t.resident_shards, t.steps_per_shard, t.seed)
        cache_layers = json.loads((cfg.work_dir / "cache" / "train" / "meta.json").read_text())["layers"]
    tcfg = TrainConfig(num_steps=t.num_steps, batch_size=t.batch_size, num_anchors=t.num_anchors, lr=t.lr,
                       warmup_steps=t.warmup_steps, weight_decay=t.weight_decay, grad_clip=t.grad_clip, seed=t.seed,
                       checkpoint_every=t.checkpoint_every, loss_weights=loss_weights(cfg.loss))
    target = _target(cfg)
    final_layer = target.model.config.num_hidden_layers
    wanted = list(model.config.target_layers)

    def features_of(batch: TrainBatch) -> torch.Tensor:
        return select_features(batch, cache_layers, final_layer, wanted)

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    report = train(model, pool, target.model.model.norm.weight.detach(), target.model.config.rms_norm_eps, tcfg,
                   cfg.run_dir / "train_state.pt", features_of)
    model.save_pretrained(final)
    if isinstance(pool, OnlinePool):  # what the online features cost this run, next to the training
        report["features"] = {"source": "online", "forward_s": round(pool.forward_s, 1),
                              "num_tokens": pool.num_tokens}
    return {"drafter": cfg.drafter, "loss": cfg.loss, "num_sequences": len(pool), **report}


def stage_calibrate(cfg: PipelineConfig) -> dict:
    """Fit STS on held-out prompts (T=1 rounds of real speculative decoding) and store the temperatures."""
    from dspark.config.engine import EngineConfig
    from dspark.models.drafters.dspark.drafter import DSparkDrafter
    from dspark.spec.calibration import fit_sts
    from dspark.training.evaluate import calibration_report, run_rounds
    from dspark.verify_service.engine import Engine

    src = cfg.run_dir / "trained"
    done = cfg.run_dir / "calibration.json"
    if cfg.drafter != "dspark" or not cfg.model.use_confidence:
        return {"skipped": True, "reason": f"{cfg.drafter} has no confidence head to calibrate"}
    if done.exists():
        return {"skipped": True, **json.loads(done.read_text())}
    target = _target(cfg)
    drafter = DSparkDrafter.from_pretrained(src, target)
    gamma = drafter.model.config.block_size
    _, held = split_records(cfg)
    prompts = [r["prompt_ids"] for r in held][: cfg.train.num_calibration_prompts]
    if not prompts:  # fitting on no rounds would store temperatures that describe nothing
        reason = (f"no held-out prompts to calibrate on ({cfg.train.heldout_fraction:.0%} of the corpus held out "
                  "by prompt hash): raise train.heldout_fraction or synth.num_prompts")
        log.warning("calibrate: %s; the drafter is exported uncalibrated", reason)
        return {"skipped": True, "reason": reason}
    engine = Engine(EngineConfig(target=cfg.target, drafter="dspark", scheduler="fixed",
                                 scheduler_kwargs={"k": gamma}, num_draft_tokens=gamma, max_num_seqs=8,
                                 max_model_len=2048), target=target, drafter=drafter)
    rounds = run_rounds(engine, prompts, 1.0, cfg.train.calibration_max_tokens, cfg.train.seed, 8)
    logits, survived, valid = rounds.calibration_arrays(gamma)
    temps = fit_sts(logits, survived, valid)
    config = json.loads((src / "config.json").read_text())
    config["sts_temperatures"] = temps
    (src / "config.json").write_text(json.dumps(config, indent=2))
    report = {"sts_temperatures": temps, "num_rounds": len(rounds.num_accepted), "tau_heldout": rounds.tau,
              **calibration_report(rounds, gamma, temps)}
    done.write_text(json.dumps(report))
    return report


def stage_export(cfg: PipelineConfig) -> dict:
    src = cfg.run_dir / "trained"
    out = cfg.output
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(src / name, out / name)
    size_mb = sum(p.stat().st_size for p in out.iterdir()) / 2**20
    return {"output": str(out), "size_mb": round(size_mb, 2)}


_TARGETS: dict[str, TargetModel] = {}


def _target(cfg: PipelineConfig) -> TargetModel:
    if cfg.target not in _TARGETS:
        _TARGETS[cfg.target] = load_target(cfg.target)
    return _TARGETS[cfg.target]


def _feature_target(cfg: PipelineConfig) -> tuple[TargetModel, str]:
    """The target that computes the training features, in `train.feature_dtype` (auto: measured fastest for
    batched prefill here), and that dtype's name."""
    from dspark.config.engine import EngineConfig, resolve_dtype

    dtype = resolve_dtype(EngineConfig(target=cfg.target, dtype=cfg.train.feature_dtype, dtype_role="generate"))
    if dtype in (None, "fp32"):
        return _target(cfg), "fp32"
    key = f"{cfg.target}@{dtype}"
    if key not in _TARGETS:
        _TARGETS[key] = load_target(cfg.target, dtype=dtype)
    return _TARGETS[key], dtype


def _layers(cfg: PipelineConfig) -> list[int]:
    return cfg.model.target_layers or default_target_layers(_target(cfg).model.config.num_hidden_layers)


def run_pipeline(cfg: PipelineConfig, stages: tuple[str, ...] = STAGES) -> dict:
    results = {}
    for name in stages:
        t0 = time.perf_counter()
        results[name] = {**globals()[f"stage_{name}"](cfg), "stage_wall_s": time.perf_counter() - t0}
        log.info("stage %s: %s", name, results[name])
    return results
