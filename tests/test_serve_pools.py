"""`pools: serve`: the verify and draft pools as Ray Serve deployments on a real local cluster (tiny model):
`serve status` lists them, the draft replica pairs with the verify replica through the scheduler and
drafts, outputs equal the single-process engine's, and killing a verify replica loses no request."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ray import serve

from tests.test_cluster_serving import app_args
from tests.test_engine_lossless import tiny_prompts
from tests.test_serve_http import serving
from tests.tiny import greedy_texts

NUM_NEW = 40


@pytest.fixture(scope="module")
def server(tiny_target_dir: Path) -> Iterator[httpx.Client]:
    args = app_args(tiny_target_dir, pools="serve", cluster_name="dspark-servepools", num_verify_workers=2,
                    num_draft_workers=1)
    with serving(args, health_timeout_s=180) as client:
        yield client


@pytest.fixture(scope="module")
def prompts(tiny_target) -> list[list[int]]:
    return tiny_prompts(tiny_target.model.config.vocab_size)[:6]


@pytest.fixture(scope="module")
def expected(tiny_target, prompts) -> list[str]:
    return greedy_texts(tiny_target, prompts, NUM_NEW)


def _complete(client: httpx.Client, prompt: list[int]) -> dict:
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": NUM_NEW,
                                                "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_pools_are_serve_deployments_that_pair_and_serve_losslessly(server, prompts, expected) -> None:
    status = serve.status().applications["dspark"].deployments
    assert {"default-verify", "default-draft"} <= set(status)
    deadline = time.monotonic() + 180
    while True:  # the scheduler pairs the draft replica with one verify replica
        sched = server.get("/v1/dspark/stats").json()["scheduler"]
        assert "replicas" in sched, sched
        verify = sched["replicas"]["verify"].values()
        # both verify replicas have announced themselves (heartbeats), one of them paired and switched
        if len(verify) == 2 and any(v.get("draft_broken") is False and v.get("draft_partner") for v in verify):
            break
        assert time.monotonic() < deadline, f"no verify replica paired with the draft replica: {sched['replicas']}"
        time.sleep(1)
    assert len(sched["replicas"]["verify"]) == 2 and len(sched["replicas"]["draft"]) == 1
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda p: _complete(server, p), prompts))
    assert [b["choices"][0]["text"] for b in bodies] == expected
    # the paired replica really drafted remotely
    after = server.get("/v1/dspark/stats").json()["scheduler"]
    assert sum(b["dspark"]["num_accepted"] for b in bodies) > 0, (after["replicas"], [b["dspark"] for b in bodies])
    placed = {p["worker_id"] for p in server.get("/v1/dspark/stats").json()["scheduler"]["placements"]}
    assert placed <= set(sched["replicas"]["verify"]) and len(placed) == 2  # the scheduler placed on both
