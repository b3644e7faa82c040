"""The Ray Serve application: `serve run configs/serve.yaml` (import path `dspark.cluster.app:build_app`).

The ingress deployment, `SpecDecodeServer`, serves the OpenAI-compatible app from `ingress/routes.py` over one
engine per A/B arm, chosen by `mode` and `pools` (see `config/serve.py`): an in-replica AsyncEngine
(inline); the arm's verify and draft pools as Serve deployments `<arm>-verify` / `<arm>-draft` that Serve
scales and heals, reached through the verify deployment's handle and its scheduler-placing request router
(`pools: serve`, serve_pools.py); or named worker actors the ingress starts and heals itself
(`pools: actors`, pools/actor_engine.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.config import BackpressureConfig

from dspark.cluster.ingress.ab import Arm
from dspark.cluster.ingress.access import KeyRing
from dspark.cluster.ingress.admission import Admission, SLATarget
from dspark.cluster.ingress.engine import GenerateEngine
from dspark.cluster.ingress.quotas import QuotaBook
from dspark.cluster.ingress.routes import build_fastapi
from dspark.config.serve import ServeAppConfig
from dspark.metrics.export import cluster_metrics_text
from dspark.verify_service.async_engine import AsyncEngine
from dspark.verify_service.engine import Engine
from dspark.verify_service.metrics import EngineMetrics

log = logging.getLogger(__name__)


def make_async_engine(config: ServeAppConfig, replica: str, verify_pool: Any = None) -> GenerateEngine:
    """inline: one target + drafter stepping on a thread of this replica; otherwise the worker pools (named
    actors started here, or the Serve verify deployment `verify_pool`)."""
    if verify_pool is not None:
        from dspark.cluster.pools.serve_engine import ServePoolEngine

        return ServePoolEngine(config, verify_pool)
    if config.mode == "inline":
        engine = Engine(config.engine_config())
        metrics = EngineMetrics(config.metrics("verify", replica))
        return AsyncEngine(engine, on_step=lambda: metrics.after_step(engine),
                           on_idle=lambda: metrics.after_step(engine))
    from dspark.cluster.pools.actor_engine import ClusterEngine

    return ClusterEngine(config)


@serve.deployment
@serve.ingress()
class SpecDecodeServer:
    """One replica: an engine behind the OpenAI-compatible FastAPI app."""

    def __init__(self, config: ServeAppConfig, verify_pools: dict[str, Any] | None = None) -> None:
        self.config = config
        self.replica = _replica_id()
        pools = verify_pools or {}
        # one engine (or set of pools) per A/B arm; a single unnamed arm without `ab_arms`
        self.arm_engines: dict[str, GenerateEngine] = {
            arm.name: make_async_engine(config.arm_config(arm), self.replica, pools.get(arm.name))
            for arm in config.ab_arms}
        self.engine: GenerateEngine = (next(iter(self.arm_engines.values())) if self.arm_engines
                                       else make_async_engine(config, self.replica, pools.get(config.arm_name)))
        log.info("dspark replica ready: model=%s mode=%s drafter=%s scheduler=%s", config.model_name,
                 config.mode, config.drafter, config.scheduler)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve calls this after __init__, so the routes can close over this replica's engine
        cfg = self.config
        arms = [Arm(a.name, a.weight) for a in cfg.ab_arms] or None
        arm_configs = {a.name: cfg.arm_config(a) for a in cfg.ab_arms} or {"default": cfg}
        quotas = QuotaBook({q.key_sha256: (q.requests_per_minute, q.tokens_per_minute)
                            for q in cfg.api_key_quotas}) if cfg.api_key_quotas else None
        app = build_fastapi(lambda: self.engine, cfg.model_name or cfg.target,
                             keys=KeyRing.from_config(cfg.api_key_sha256, cfg.admin_api_key_sha256),
                             admission={name: make_admission(c) for name, c in arm_configs.items()},
                             quotas=quotas, cluster_name=cfg.cluster_name,
                             max_body_bytes=cfg.max_body_bytes, arms=arms,
                             arm_engines={name: (lambda e=e: e) for name, e in self.arm_engines.items()} or None,
                             request_log=Path(cfg.request_log).expanduser() if cfg.request_log else None,
                             metrics=({a.name: cfg.arm_config(a).metrics("ingress", self.replica) for a in cfg.ab_arms}
                                      or {"default": cfg.metrics("ingress", self.replica)}),
                             metrics_text=cluster_metrics_text)
        self.gate = app.state.admission_gate
        return app

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Each arm's admission pressure (demand over what its verify replicas serve within the SLA) for the
        application's autoscaling policy: it scales the pool before admission has to shed
        (autoscale/serve_policy.py)."""
        gate = getattr(self, "gate", None)
        return gate.autoscaling_stats() if gate is not None else {}

    def check_health(self) -> None:
        # Serve restarts a replica whose engine loop died instead of routing traffic to it
        if not all(e.is_alive for e in [self.engine, *self.arm_engines.values()]):
            raise RuntimeError("engine loop is not running")

    def __del__(self) -> None:
        engines = {id(e): e for e in [getattr(self, "engine", None), *getattr(self, "arm_engines", {}).values()]}
        for engine in engines.values():
            shutdown = getattr(engine, "shutdown", None)
            if shutdown is not None:
                shutdown()


def make_admission(config: ServeAppConfig) -> Admission:
    """One arm's admission: by the SLA's predicted latency (or the static limit only), within the static bound."""
    sla = config.sla
    return Admission(config.capacity, config.max_queued_requests,
                     SLATarget(sla.ttft_s, sla.tpot_s, sla.headroom) if config.admission == "sla" else None,
                     max_batch=config.max_num_seqs, num_ingress_replicas=config.num_replicas,
                     stream_interval_s=config.stream_interval_ms / 1e3)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (tests building the class directly)
        return f"pid{os.getpid()}"


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder: validates `args` (see ServeAppConfig) and binds the deployment."""
    config = args if isinstance(args, ServeAppConfig) else ServeAppConfig.model_validate(args or {})
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica}
    if config.num_gpus_per_replica and config.mode == "inline":
        actor_options["num_gpus"] = config.num_gpus_per_replica
    pools = None
    if config.pools == "serve" and config.mode != "inline":  # each arm's pools as Serve deployments
        from dspark.cluster.pools.serve_pools import pool_deployments

        arms = [config.arm_config(a) for a in config.ab_arms] or [config]
        pools = {arm.arm_name: pool_deployments(arm) for arm in arms}
    # overload is refused in two places, both before any work: the replica (per arm, up to
    # max_ongoing_requests in it) and, past that and a short proxy queue, Serve's proxy itself
    # a fixed number of ingress replicas, given as an autoscaling range of one size: that puts the ingress
    # in the application-level policy's view, which reads each arm's admission pressure from it
    deployment = SpecDecodeServer.options(autoscaling_config={
                                              "min_replicas": config.num_replicas,
                                              "max_replicas": config.num_replicas,
                                              "initial_replicas": config.num_replicas,
                                              # the admission pressure reaches the policy within a second
                                              # (Serve's default report interval is 10 s)
                                              "metrics_interval_s": 1.0, "look_back_period_s": 5.0},
                                          max_ongoing_requests=config.max_ongoing_requests,
                                          # the proxy's queue also holds requests its router has not
                                          # assigned yet: a burst of the admission limit must fit in it
                                          max_queued_requests=config.admission_limit,
                                          backpressure_config=BackpressureConfig(
                                              status_code=429, retry_after_s=config.proxy_retry_after_s),
                                          ray_actor_options=actor_options)
    return deployment.bind(config, pools)
