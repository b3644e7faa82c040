"""Starting the worker pools and the scheduler of one dspark cluster, and pairing draft with verify.

Actors are named `<cluster_name>-verify-<i>`, `<cluster_name>-draft-<i>` and `<cluster_name>-scheduler`
and created with get_if_exists, so a second ingress replica (or a restarted one) finds the running pools
instead of starting new ones. Resources come from the config; a resource the cluster does not have is a
clear error here rather than actors pending forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray

from dspark.actors.scheduler_actor import get_or_create_scheduler
from dspark.config.serve import ServeAppConfig, WorkerResources
from dspark.draft_service.worker import DraftWorkerActor
from dspark.verify_service.worker import VerifyWorkerActor

log = logging.getLogger(__name__)

ACTOR_NAMESPACE = "dspark"  # explicit, so drivers, Serve replicas and workers all find the same actors


@dataclass
class Pools:
    verify: dict[str, Any]  # worker id -> actor handle
    draft: dict[str, Any]
    scheduler: Any
    info: dict[str, dict[str, Any]]  # worker id -> ready() answer (node, pid, pairing)
    pairs: dict[str, str]  # verify worker id -> draft worker id


def check_resources(config: ServeAppConfig) -> None:
    """Raise ValueError if the pools can never be placed on this cluster."""
    have = ray.cluster_resources()
    pools: list[tuple[str, WorkerResources, int]] = [("verify_worker", config.verify_worker, config.num_verify_workers)]
    if config.mode == "decoupled":
        pools.append(("draft_worker", config.draft_worker, config.num_draft_workers))
    need: dict[str, float] = {}
    for _, res, n in pools:
        need["CPU"] = need.get("CPU", 0.0) + res.num_cpus * n
        if res.num_gpus:
            need["GPU"] = need.get("GPU", 0.0) + res.num_gpus * n
        for key, amount in res.resources.items():
            if key not in have:
                raise ValueError(f"resource {key!r} is not in this Ray cluster (it has {sorted(have)}); start "
                                 f"nodes with `ray start --resources '{{\"{key}\": N}}'` or change the config")
            need[key] = need.get(key, 0.0) + amount * n
    for key, amount in need.items():
        if amount > have.get(key, 0.0) + 1e-9:
            raise ValueError(f"the pools need {amount:g} {key} in total but the cluster has "
                             f"{have.get(key, 0.0):g}; lower num_*_workers or the per-worker resources")


def start_pools(config: ServeAppConfig, timeout_s: float = 900.0) -> Pools:
    """Create (or find) the scheduler and pools, wait until they are ready, pair them."""
    check_resources(config)
    name = config.cluster_name
    scheduler = get_or_create_scheduler(f"{name}-scheduler", ACTOR_NAMESPACE,
                                        {"model_name": config.model_name or config.target, "arm": config.arm_name,
                                         "replica": f"{name}-scheduler"})
    # a killed worker is restarted by Ray (its process, its model); the ingress re-pairs it and, meanwhile,
    # resumes the dead one's requests elsewhere (actor_engine.py). Calls are never retried by Ray: a
    # stream that broke is resumed from its committed tokens by the ingress, not replayed
    common = {"namespace": ACTOR_NAMESPACE, "get_if_exists": True, "max_restarts": -1, "max_task_retries": 0}
    verify = {f"{name}-verify-{i}": VerifyWorkerActor.options(
        name=f"{name}-verify-{i}", **common, **config.verify_worker.actor_options()
    ).remote(f"{name}-verify-{i}", config) for i in range(config.num_verify_workers)}
    draft: dict[str, Any] = {}
    if config.mode == "decoupled":
        draft = {f"{name}-draft-{i}": DraftWorkerActor.options(
            name=f"{name}-draft-{i}", **common, **config.draft_worker.actor_options()
        ).remote(f"{name}-draft-{i}", config) for i in range(config.num_draft_workers)}
    handles = {**verify, **draft}
    answers = ray.get([h.ready.remote() for h in handles.values()], timeout=timeout_s)
    info = dict(zip(handles, answers))
    pairs: dict[str, str] = {}
    for vid, did in zip(verify, draft):
        if info[vid]["is_serving"]:  # an earlier ingress paired it already
            pairs[vid] = info[vid]["paired_with"]
            continue
        pair(verify[vid], draft[did], did, info[did]["hidden_layers"], config.transport, timeout_s)
        pairs[vid] = did
        info[vid] = ray.get(verify[vid].ready.remote())
    ray.get(scheduler.ping.remote(), timeout=timeout_s)
    log.info("dspark pools ready: %s", {k: (v["node_id"][:8], v["pid"]) for k, v in info.items()})
    return Pools(verify, draft, scheduler, info, pairs)


def pair(verify: Any, draft: Any, draft_id: str, hidden_layers: list[int], transport: str,
         timeout_s: float = 120.0) -> None:
    """Connect one verify worker to one draft worker (both sides join a fresh channel of `transport`)."""
    if transport in ("socket", "gloo"):
        host, port = ray.get(verify.channel_address.remote(), timeout=timeout_s)
        ray.get([verify.pair_channel.remote(draft_id, hidden_layers), draft.pair_channel.remote(host, port)],
                timeout=timeout_s)
    else:
        ray.get(verify.pair_ray.remote(draft_id, draft, hidden_layers), timeout=timeout_s)
