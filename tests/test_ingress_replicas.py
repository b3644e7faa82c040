"""Two ingress replicas in front of shared Serve pools (tiny model, real local cluster, loopback): kill -9
one ingress replica under steady load, behind either front door (Serve's proxy, HAProxy). Requests started
after the door has noticed go through the survivor (none fails); only those whose HTTP stream the dead replica
itself was serving can fail; Serve brings the replica back; afterwards the pools hold no request of the dead
replica (its streams were cancelled)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from dspark.cluster.ingress.front_door import haproxy_binary
from tests.test_cluster_serving import app_args
from tests.test_engine_lossless import tiny_prompts
from tests.test_serve_http import serving
from tests.tiny import greedy_texts

NUM_NEW = 24
INGRESS = "SpecDecodeServer"


# both front doors: Serve's proxy routes around the dead replica; HAProxy retries the connection on the
# survivor and marks the dead one down
DOORS = ["proxy", pytest.param("haproxy", marks=pytest.mark.skipif(
    haproxy_binary() is None and not os.environ.get("DSPARK_REQUIRE_HAPROXY"), reason="haproxy not installed"))]


@pytest.fixture(scope="module", params=DOORS)
def server(request: pytest.FixtureRequest, tiny_target_dir: Path) -> Iterator[httpx.Client]:
    args = app_args(tiny_target_dir, pools="serve", cluster_name="dspark-ingress", num_replicas=2,
                    num_verify_workers=1, num_draft_workers=1)
    with serving(args, health_timeout_s=180, front_door=request.param) as client:
        yield client


def _ingress_pids() -> list[int]:
    """The ingress replicas' processes, by their process title (`ray::ServeReplica:dspark:SpecDecodeServer`).
    Not through Ray's state API or `serve.status()` from this driver: with them, a background thread of this
    process reconnected to the next test module's cluster after `ray.shutdown()` (test_multinode failed)."""
    return sorted(p.pid for p in psutil.process_iter(["cmdline"])
                  if f"ServeReplica:dspark:{INGRESS}" in " ".join(p.info["cmdline"] or []))


def _wait(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_one_dead_ingress_replica_does_not_stop_new_requests(server, tiny_target) -> None:
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:4]
    expected = greedy_texts(tiny_target, prompts, NUM_NEW)
    _wait(lambda: len(_ingress_pids()) == 2, 120, "two ingress replicas")
    records: list[tuple[float, float, int | None, bool]] = []  # (start, end, status, output as expected)
    stop = threading.Event()

    def client_loop(i: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    resp = c.post("/v1/completions", json={"model": "tiny", "prompt": prompts[i], "temperature": 0,
                                                           "max_tokens": NUM_NEW, "ignore_eos": True})
                    ok = resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected[i]
                    # a 429 counts as the door's back-pressure only with the Retry-After a client needs
                    status = resp.status_code if resp.status_code != 429 or "retry-after" in resp.headers else -429
                    records.append((t0, time.monotonic(), status, ok))
                except httpx.HTTPError:
                    records.append((t0, time.monotonic(), None, False))

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(4.0)
    victim = _ingress_pids()[0]
    t_kill = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    time.sleep(12.0)
    stop.set()
    for t in threads:
        t.join(timeout=90)

    before = [r for r in records if r[1] < t_kill]
    during = [r for r in records if r[0] < t_kill <= r[1]]  # in flight at the kill
    after = [r for r in records if r[0] >= t_kill]
    assert before and all(r[3] for r in before)
    failed_after = [r for r in after if not r[3]]
    # a request Serve's proxy had already routed to the dying replica may fail in the first instant;
    # every one started a second after the kill goes through the survivor. Admission may still refuse one
    # with 429 + Retry-After while the pools finish the dead replica's cancelled requests (seen in CI behind
    # HAProxy: one 429 in ~40 requests): back-pressure a client retries, not a failure, if it stays rare
    refused = [r for r in failed_after if r[2] == 429]
    assert not [r for r in failed_after if r[0] >= t_kill + 1.0 and r[2] != 429], failed_after
    assert len(refused) <= max(2, len(after) // 10), refused
    assert len([r for r in after if r[3]]) >= len(prompts), "the survivor served new requests"
    print(f"in flight at the kill: {len(during)} ({sum(1 for r in during if not r[3])} failed); "
          f"started after: {len(after)} ({len(failed_after) - len(refused)} failed, all within 1 s of the kill; "
          f"{len(refused)} refused with 429 + Retry-After)")
    _wait(lambda: len(_ingress_pids()) == 2 and victim not in _ingress_pids(), 120, "Serve to replace the replica")

    def nothing_held() -> bool:
        stats = server.get("/v1/dspark/stats").json()
        reps = stats.get("scheduler", {}).get("replicas", {}).get("verify", {})
        return bool(reps) and all(v.get("num_running") == 0 and v.get("num_waiting") == 0 for v in reps.values())

    _wait(nothing_held, 60, "the verify pool to hold no request")
    assert server.get("/health").status_code == 200
