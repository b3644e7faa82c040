"""`dspark train --config ...`: synth → (later stages) with each stage skipped when its output exists."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from dspark.training.pipeline_config import PipelineConfig
from dspark.training.synth import SynthConfig, run_synthesis

log = logging.getLogger(__name__)

STAGES = ("synth",)


def data_dir(cfg: PipelineConfig) -> Path:
    return cfg.work_dir / "data"


def stage_synth(cfg: PipelineConfig) -> dict:
    from dspark.verify_service.engine import Engine, EngineConfig

    out = data_dir(cfg)
    done = out / "DONE.json"
    if done.exists():
        return {"skipped": True, **json.loads(done.read_text())}
    e = cfg.engine
    engine = Engine(EngineConfig(target=cfg.target, drafter=e.drafter, scheduler=e.scheduler,
                                 max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len))
    s = cfg.synth
    report = run_synthesis(engine, SynthConfig(
        num_prompts=s.num_prompts, num_stdlib_prompts=s.num_stdlib_prompts, domain_mix=dict(s.domain_mix),
        shard_size=s.shard_size, prompt_max_tokens=s.prompt_max_tokens, response_max_tokens=s.response_max_tokens,
        response_temperature=s.response_temperature, response_top_p=s.response_top_p, seed=s.seed), out)
    done.write_text(json.dumps({**report, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    return report


def run_pipeline(cfg: PipelineConfig, stages: tuple[str, ...] = STAGES) -> dict:
    results = {}
    for name in stages:
        t0 = time.perf_counter()
        results[name] = {**globals()[f"stage_{name}"](cfg), "stage_wall_s": time.perf_counter() - t0}
        log.info("stage %s: %s", name, results[name])
    return results
