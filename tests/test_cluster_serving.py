"""The distributed serving core on a real local Ray cluster (tiny model): decoupled draft/verify pools
behind the HTTP ingress, gloo transport, the central scheduler, and a scheduler restart mid-traffic."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray

from dspark.config.engine import EngineConfig
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams
from tests.test_engine_lossless import tiny_prompts
from tests.test_serve_http import serving
from tests.tiny import tiny_sps_path

MODEL = "tiny"
NUM_NEW = 20
CLUSTER = "dspark-test"


def app_args(target_dir: Path, **extra: object) -> dict:
    small = {"num_cpus": 0.25, "num_threads": 1}
    return {"target": str(target_dir), "model_name": MODEL, "drafter": "ngram", "scheduler": "central",
            "num_draft_tokens": 5, "max_model_len": 256, "max_num_seqs": 6, "mode": "decoupled",
            "num_verify_workers": 2, "num_draft_workers": 2, "verify_worker": small, "draft_worker": small,
            "transport": "gloo", "cluster_name": CLUSTER, "num_cpus_per_replica": 0.25,
            # a tiny model verifies in ~1 ms, so the draft gate would (rightly) stop paying for remote drafts;
            # these tests are about the draft path, so it stays on
            "draft_gate": False,
            # and the verification lengths follow the tiny model's test curve, not a profile measured at start-up
            # in ~1 ms steps (one burst of noise in it, and the scheduler rightly verifies nothing: seen in CI)
            "sps_profile": tiny_sps_path(target_dir), **extra}


@pytest.fixture(scope="module")
def server(tiny_target_dir: Path) -> Iterator[httpx.Client]:
    with serving(app_args(tiny_target_dir), health_timeout_s=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_target):  # noqa: ANN201
    return tiny_target.tokenizer


@pytest.fixture(scope="module")
def prompts(tiny_target) -> list[list[int]]:
    return tiny_prompts(tiny_target.model.config.vocab_size)[:10]


@pytest.fixture(scope="module")
def single_process(tiny_target, prompts) -> list[list[int]]:
    cfg = EngineConfig(target=str(tiny_target.path), drafter="ngram", scheduler="greedy", num_draft_tokens=5,
                       max_num_seqs=6, max_model_len=256)
    reqs = Engine(cfg, target=tiny_target).generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    return [r.output_ids for r in reqs]


def complete(client: httpx.Client, prompt: list[int]) -> dict:
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": NUM_NEW,
                                                "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def run_all(client: httpx.Client, prompts: list[list[int]]) -> list[dict]:
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(client, p), prompts))


def test_decoupled_pools_serve_concurrent_requests_identical_to_the_single_process_engine(
        server, prompts, single_process, tokenizer):
    bodies = run_all(server, prompts)
    texts = [b["choices"][0]["text"] for b in bodies]
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in single_process]
    assert all(b["usage"]["completion_tokens"] == NUM_NEW for b in bodies)
    assert sum(b["dspark"]["num_accepted"] for b in bodies) > 0  # the remote drafts were really used

    stats = server.get("/v1/dspark/stats").json()
    verify = {w: s for w, s in stats["workers"].items() if "-verify-" in w}
    draft = {w: s for w, s in stats["workers"].items() if "-draft-" in w}
    assert len(verify) == 2 and len(draft) == 2
    assert set(stats["pairs"].values()) == set(draft)
    # both verify workers got requests (placement spreads them) and talked to their own draft worker
    assert all(s["num_steps"] > 0 and s["transport"] == "gloo" for s in verify.values())
    assert all(s["num_messages"] > 0 and s["error"] is None for s in draft.values())
    # transport per drafted round, and the same total spread over every step (never more)
    assert all(0 < s["transport_ms_per_step"] <= s["transport_ms_mean"] * s["num_steps"] for s in verify.values())
    assert all({"micro_batch", "start_s", "end_s"} <= set(s["timeline"][0]) for s in verify.values())
    assert {t["micro_batch"] for s in verify.values() for t in s["timeline"]} == {0, 1}  # ping-pong
    sched = stats["scheduler"]
    assert sched["num_reports"] > 0 and len(sched["placements"]) >= len(prompts)
    assert set(sched["capacity"]) == set(verify)


def test_a_scheduler_restart_loses_no_request(server, prompts, single_process, tokenizer):
    scheduler = ray.get_actor(f"{CLUSTER}-scheduler", namespace="dspark")
    before = ray.get(scheduler.ping.remote())
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, server, p) for p in prompts]
        time.sleep(0.5)
        ray.kill(scheduler, no_restart=False)  # Ray restarts it (max_restarts=-1)
        bodies = [f.result(timeout=300) for f in futures]
    texts = [b["choices"][0]["text"] for b in bodies]
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in single_process]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the restarted scheduler rebuilds its state from new reports
        try:
            if ray.get(scheduler.ping.remote(), timeout=5) != before:
                break
        except Exception:  # noqa: BLE001 - still restarting
            time.sleep(0.5)
    assert ray.get(scheduler.ping.remote(), timeout=30) != before
    run_all(server, prompts[:4])
    assert ray.get(scheduler.snapshot.remote(), timeout=30)["num_reports"] > 0


def test_bad_requests_are_400s_in_pool_mode(server):
    resp = server.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 10_000})
    assert resp.status_code == 400 and "max_model_len" in resp.text
    resp = server.post("/v1/completions", json={"model": MODEL, "prompt": [10**6], "max_tokens": 4})
    assert resp.status_code == 400
