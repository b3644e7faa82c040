"""The HAProxy front door (Serve direct ingress) on a real local cluster: HAProxy owns the port, requests and
streams go through it to the ingress replica's own HTTP server, bad input is a 4xx with a reason, overload
a 429 with Retry-After, and the environment that selected it is restored afterwards."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from dspark.cluster.ingress.front_door import IDLE_ENV, front_door_env, haproxy_binary
from dspark.config.cpu_priority import REQUEST_PATH_ENV
from tests.test_serve_http import MODEL, _sse_events, serving

pytestmark = pytest.mark.skipif(haproxy_binary() is None and not os.environ.get("DSPARK_REQUIRE_HAPROXY"),
                                reason="Debian package `haproxy` is not installed (apt-get install haproxy); "
                                ".ci/run installs it and requires it")


def _listener(port: int) -> str:
    """Name of the process listening on 127.0.0.1:port."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid).name()
    return ""


def test_haproxy_front_door_serves_streams_and_refuses_cleanly(tiny_target_dir: Path) -> None:
    assert front_door_env("proxy") == {**REQUEST_PATH_ENV, **IDLE_ENV}  # either door: the idle controller loop
    assert front_door_env("haproxy")["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert front_door_env("haproxy")["RAY_worker_niceness"] == "0"
    args = {"target": str(tiny_target_dir), "model_name": MODEL, "drafter": "ngram", "scheduler": "fixed",
            "num_draft_tokens": 3, "max_model_len": 2048, "max_num_seqs": 1, "max_queued_requests": 1,
            "num_threads": 1, "admission": "static"}  # the fixed limit of 2 (SLA: test_front_door_burst.py)
    with serving(args, front_door="haproxy") as client:
        assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == IDLE_ENV["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]
        assert _listener(client.base_url.port) == "haproxy"
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "the cat", "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 8 and resp.headers["x-request-id"]
        events = _sse_events(client, "/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                              "temperature": 0, "ignore_eos": True})
        assert events[-1] == "[DONE]" and len(events) > 2
        bad = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert bad.status_code in (400, 404) and "nope" in bad.json()["error"]["message"]
        # ten long requests at once on a limit of 2 (1 batched + 1 queued): the rest are 429 + Retry-After
        statuses: list[httpx.Response] = []

        def one() -> None:
            with httpx.Client(base_url=str(client.base_url), timeout=120) as c:
                statuses.append(c.post("/v1/completions", json={"model": MODEL, "prompt": "the dog",
                                                                "max_tokens": 400, "ignore_eos": True}))

        threads = [threading.Thread(target=one) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in statuses)
        assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 1, codes
        for r in statuses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1, (r.headers, r.text)
                # ours: a JSON error with a reason; Serve's own backpressure 429 (past max_ongoing_requests,
                # app.py) carries its reason as text
                if r.headers.get("content-type", "").startswith("application/json"):
                    assert r.json()["error"]["message"]
                else:
                    assert r.text.strip(), (r.headers, r.text)
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in os.environ  # the next cluster gets Serve's proxy again
