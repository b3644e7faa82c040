"""`dspark prepare`: everything a serve config's replicas prepare on first start, done once, before it.

On a fresh machine the first replicas used to do this work themselves, all at once, while the server
already looked up: converting the embedded GGUF, building the native kernels, measuring the dtype per role,
the GEMM plans of the target and of each drafter, and the SPS profile of an unknown CPU. `make serve`
runs this first, so `serve run` starts from a warm cache and a replica is ready as soon as its weights
are loaded. Each step builds exactly what a replica builds (the same code, the same thread count, since
plans are keyed by it) and caches it per machine under a lock (`kernels/cache_once.py`), so it is also
safe to run while replicas start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from dspark.config.serve import ServeAppConfig
from dspark.kernels import cache_once

log = logging.getLogger(__name__)

APP_IMPORT_PATH = "dspark.cluster.app:build_app"


@dataclass
class Step:
    """One preparation: `key` identifies what it builds (arms that share it prepare it once)."""

    key: tuple
    label: str
    run: Callable[[], Any]


def app_configs(serve_yaml: Path) -> list[ServeAppConfig]:
    """The config of every arm of every dspark application in a Serve config file."""
    doc = yaml.safe_load(serve_yaml.read_text()) or {}
    configs = []
    for app in doc.get("applications", []):
        if app.get("import_path") != APP_IMPORT_PATH:
            continue
        config = ServeAppConfig.model_validate(app.get("args") or {})
        configs += [config.arm_config(a) for a in config.ab_arms] or [config]
    if not configs:
        raise ValueError(f"{serve_yaml}: no application with import_path {APP_IMPORT_PATH}")
    return configs


def _verify_engine(config: ServeAppConfig) -> str:
    from dspark.verify_service.engine import Engine

    engine = Engine(config.worker_engine_config())  # target, dtype, GEMM plan, SPS profile: as a verify replica
    return f"{engine.target.dtype}".removeprefix("torch.")


def _drafter(config: ServeAppConfig) -> str:
    from dspark.config.engine import resolve_dtype
    from dspark.models.drafters.registry import make_drafter
    from dspark.models.target.loader import load_target

    torch.set_num_threads(config.draft_worker.threads())  # the draft replica's: plans are keyed by it
    target = load_target(config.target, config.device, resolve_dtype(config.engine_config()))
    make_drafter(config.drafter, target, **dict(config.drafter_kwargs))
    return config.drafter


def steps_for(configs: list[ServeAppConfig]) -> list[Step]:
    """The preparations the replicas of these configs would do, each once, in the order they need them."""
    from dspark.kernels import native
    from dspark.models.target.loader import resolve_target_path

    steps: list[Step] = []
    for c in configs:
        steps.append(Step(("target", c.target), f"target {Path(c.target).name}",
                          lambda c=c: str(resolve_target_path(c.target))))
        if c.device == "cpu":
            steps.append(Step(("native",), "native kernels", lambda: native.build_id()))
        threads = c.verify_worker.threads()
        steps.append(Step(("verify", c.target, c.device, c.dtype, threads, c.scheduler, c.sps_profile),
                          f"{c.arm_name}: verify engine (dtype, GEMM plan, SPS profile)",
                          lambda c=c: _verify_engine(c)))
        if c.mode == "decoupled" and c.drafter != "none":
            steps.append(Step(("draft", c.target, c.device, c.dtype, c.drafter, c.draft_worker.threads()),
                              f"{c.arm_name}: drafter {c.drafter}", lambda c=c: _drafter(c)))
    unique: dict[tuple, Step] = {}
    for step in steps:
        unique.setdefault(step.key, step)
    return list(unique.values())


def prepare(serve_yaml: Path, show_progress: bool = True) -> dict[str, Any]:
    """Run every step of the config's arms; {"steps": [{label, s, result}], "total_s"}. A step that fails
    raises PrepareError with one line naming the cause and the fix."""
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    steps = steps_for(app_configs(serve_yaml))
    done = []
    bar = tqdm(steps, desc="prepare", unit="step", disable=not show_progress)
    try:
        for step in bar:
            bar.set_postfix_str(step.label)
            t0 = time.perf_counter()
            try:
                result = step.run()
            except cache_once.PrepareError:
                raise
            except Exception as exc:
                raise cache_once.PrepareError(cache_once.explain(exc, f"prepare: {step.label}")) from exc
            done.append({"step": step.label, "s": round(time.perf_counter() - t0, 1), "result": result})
    finally:
        bar.close()
        torch.set_num_threads(threads_before)
    return {"config": str(serve_yaml), "cache": str(cache_once.cache_root()), "steps": done,
            "total_s": round(time.perf_counter() - t_start, 1)}
