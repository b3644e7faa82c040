"""The Ray Serve application: `serve run configs/serve.yaml` (import path `dspark.cluster.app:build_app`).

One deployment, `SpecDecodeServer`, holds an AsyncEngine and serves the OpenAI-compatible app from
`openai_api`. Building the engine is a separate function (`make_async_engine`) so that a distributed
engine (draft/verify actor pools) can be swapped in without touching the HTTP layer.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve

from dspark.cluster.openai_api import GenerateEngine, build_fastapi
from dspark.models.target import DEFAULT_TARGET
from dspark.verify_service.async_engine import AsyncEngine
from dspark.verify_service.engine import Engine, EngineConfig

log = logging.getLogger(__name__)


class ServeAppConfig(BaseModel):
    """The `args:` of the dspark application in serve.yaml."""

    # a typo in serve.yaml must fail loudly rather than silently fall back to a default
    model_config = ConfigDict(extra="forbid")

    target: str = Field(DEFAULT_TARGET, description="Target model: the embedded default or a HF folder.")
    device: str = Field("cpu", description="Torch device of the target, e.g. 'cpu' or 'cuda'.")
    dtype: str | None = Field(None, description="fp32/bf16/fp16; null: fp32 on CPU, bf16 on GPU.")
    drafter: str = Field("ngram", description="Drafter name (ngram, dspark, dflash, eagle3, mtp, ...).")
    drafter_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra drafter arguments.")
    scheduler: str = Field("fixed", description="Prefix scheduler: fixed, greedy, ...")
    scheduler_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra scheduler arguments.")
    num_draft_tokens: int = Field(7, ge=0, description="γ: most tokens drafted per request and step.")
    sps_profile: str | None = Field(
        None, description="SPS profile JSON; null: configs/profiles/<device>.json (unused by 'fixed').")
    max_num_seqs: int = Field(16, ge=1, description="Most requests batched at once per replica.")
    max_model_len: int = Field(2048, ge=2, description="Most tokens (prompt + output) per request.")
    num_threads: int | None = Field(
        None, ge=1, description="Torch CPU threads; null: num_cpus_per_replica rounded, at least 1.")
    model_name: str | None = Field(None, description="Name served as `model` in the API; null: target.")
    num_replicas: int = Field(1, ge=1, description="Serve replicas, each with its own engine.")
    num_cpus_per_replica: float = Field(1.0, gt=0, description="Ray CPUs reserved per replica.")
    num_gpus_per_replica: float = Field(0.0, ge=0, description="Ray GPUs reserved per replica.")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests in flight per replica; null: 2 * max_num_seqs, so a queue "
                                "forms in the engine (which batches) rather than in the proxy.")

    @model_validator(mode="after")
    def _fill_defaults(self) -> ServeAppConfig:
        if self.model_name is None:
            self.model_name = self.target
        if self.max_ongoing_requests is None:
            self.max_ongoing_requests = 2 * self.max_num_seqs
        return self

    def engine_config(self) -> EngineConfig:
        num_threads = self.num_threads or max(1, round(self.num_cpus_per_replica))
        return EngineConfig(target=self.target, device=self.device, dtype=self.dtype, drafter=self.drafter,
                            drafter_kwargs=dict(self.drafter_kwargs), scheduler=self.scheduler,
                            scheduler_kwargs=dict(self.scheduler_kwargs),
                            num_draft_tokens=self.num_draft_tokens, sps_profile=self.sps_profile,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            num_threads=num_threads)


def make_async_engine(config: ServeAppConfig) -> AsyncEngine:
    """The in-process engine: one target + drafter, stepping on a background thread."""
    return AsyncEngine(Engine(config.engine_config()))


@serve.deployment
@serve.ingress()
class SpecDecodeServer:
    """One replica: an engine behind the OpenAI-compatible FastAPI app."""

    def __init__(self, config: ServeAppConfig) -> None:
        self.config = config
        self.engine: GenerateEngine = make_async_engine(config)
        log.info("dspark replica ready: model=%s drafter=%s scheduler=%s", config.model_name,
                 config.drafter, config.scheduler)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve calls this after __init__, so the routes can close over this replica's engine
        return build_fastapi(lambda: self.engine, self.config.model_name or self.config.target)

    def check_health(self) -> None:
        # Serve restarts a replica whose engine loop died instead of routing traffic to it
        if not self.engine.is_alive:
            raise RuntimeError("engine loop is not running")

    def __del__(self) -> None:
        shutdown = getattr(getattr(self, "engine", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder: validates `args` (see ServeAppConfig) and binds the deployment."""
    config = args if isinstance(args, ServeAppConfig) else ServeAppConfig.model_validate(args or {})
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica}
    if config.num_gpus_per_replica:
        actor_options["num_gpus"] = config.num_gpus_per_replica
    deployment = SpecDecodeServer.options(num_replicas=config.num_replicas,
                                          max_ongoing_requests=config.max_ongoing_requests,
                                          ray_actor_options=actor_options)
    return deployment.bind(config)
