"""Ray's own multi-node test cluster (two raylets with distinct logical resources): the pools land on the
nodes the config names, requests are served across them, and both transports move exact tensors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from dspark.actors.transport_probe import measure_transports
from dspark.cluster.pools.actor_engine import ClusterEngine
from dspark.cluster.pools.actor_pools import check_resources, start_pools
from dspark.config.serve import ServeAppConfig
from dspark.verify_service.request import SamplingParams


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"verify_node": 4}})
    draft_node = c.add_node(num_cpus=1, resources={"draft_node": 4})
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    try:
        c.wait_for_nodes()
        yield {"head": c.head_node.node_id, "draft": draft_node.node_id}
    finally:
        ray.shutdown()
        c.shutdown()


def config(target_dir: Path, **extra: object) -> ServeAppConfig:
    return ServeAppConfig.model_validate({
        "target": str(target_dir), "drafter": "ngram", "scheduler": "central", "num_draft_tokens": 4,
        "max_model_len": 128, "max_num_seqs": 4, "mode": "decoupled", "num_verify_workers": 2,
        "num_draft_workers": 2, "cluster_name": "multinode", "transport": "gloo",
        "verify_worker": {"num_cpus": 0.25, "num_threads": 1, "resources": {"verify_node": 1}},
        "draft_worker": {"num_cpus": 0.25, "num_threads": 1, "resources": {"draft_node": 1}}, **extra})


@pytest.mark.parametrize("transport", ["socket", "gloo", "ray"])
def test_pools_land_on_the_nodes_their_resources_name_and_serve_across_them(cluster, tiny_target_dir, transport):
    cfg = config(tiny_target_dir, transport=transport, cluster_name=f"multinode-{transport}")
    engine = ClusterEngine(cfg)
    try:
        nodes = {wid: info["node_id"] for wid, info in engine.pools.info.items()}
        assert {nodes[w] for w in engine.pools.verify} == {cluster["head"]}
        assert {nodes[w] for w in engine.pools.draft} == {cluster["draft"]}

        async def one(prompt: list[int]) -> list[int]:
            out = []
            async for step in engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)):
                out = step.output_ids
            return out

        async def many() -> list[list[int]]:
            return await asyncio.gather(*(one([5, 6, 7, 5, 6, 7, i + 4]) for i in range(4)))

        outputs = asyncio.run(many())
        assert all(len(o) == 12 for o in outputs)
        stats = engine.stats()
        assert all(stats["workers"][w]["num_messages"] > 0 for w in engine.pools.draft)
        assert all(stats["workers"][w]["transport"] == transport for w in engine.pools.verify)
    finally:
        engine.shutdown()  # stops its healer thread, which would otherwise call Ray after the module's teardown
        for handle in {**engine.pools.verify, **engine.pools.draft}.values():
            ray.kill(handle)
        ray.kill(engine.pools.scheduler)


def test_a_resource_the_cluster_lacks_is_a_clear_error(cluster, tiny_target_dir):
    cfg = config(tiny_target_dir, draft_worker={"num_cpus": 0.25, "resources": {"gpu_node": 1}})
    with pytest.raises(ValueError, match="'gpu_node' is not in this Ray cluster"):
        check_resources(cfg)
    with pytest.raises(ValueError, match="need 6 draft_node in total but the cluster has 4"):
        start_pools(config(tiny_target_dir, num_draft_workers=3, num_verify_workers=3, draft_worker={
            "num_cpus": 0.1, "resources": {"draft_node": 2}}))


def test_socket_gloo_and_ray_transports_move_exact_tensors_between_nodes(cluster):
    result = measure_transports([16, 256], num_features=3 * 64, reps=5,
                                options_a={"num_cpus": 0, "resources": {"verify_node": 0.01}},
                                options_b={"num_cpus": 0, "resources": {"draft_node": 0.01}})
    assert result["nodes"] == [cluster["head"], cluster["draft"]]
    for transport in ("socket", "gloo", "ray"):
        assert all(r["is_exact"] and r["rtt_ms_median"] > 0 for r in result[transport].values())
