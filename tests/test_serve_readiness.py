"""Ready means ready: on a fresh cache (native kernels, GEMM plans and the SPS profile of an "unknown" CPU
still to be made by the verify replica) the ingress answers 503 + Retry-After, never 500, until a chat
would be answered; `/v1/models` turns 200 only then, and the verify deployment is reported healthy only
once its replica can answer."""

from __future__ import annotations

import collections
import contextlib
import os
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from dspark.actors.transport import free_port
from dspark.cluster.app import build_app
from dspark.cluster.ingress.front_door import front_door_environment
from dspark.kernels import cache_once
from tests.test_cluster_serving import app_args

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def _verify_is_healthy() -> bool:
    try:
        app = serve.status().applications.get("dspark")
        return app is not None and app.deployments["default-verify"].status == "HEALTHY"
    except Exception:  # noqa: BLE001 - the controller is still coming up
        return False


def test_warming_pools_answer_503_with_retry_after_until_a_chat_would_be_answered(
        tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an empty cache and no shipped profiles: the verify replica builds the kernels, plans its GEMMs and
    # measures a profile before it can answer (the replicas inherit this environment through ray.init)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    (tmp_path / "no-profiles").mkdir()
    monkeypatch.setenv("DSPARK_PROFILES_DIR", str(tmp_path / "no-profiles"))
    for var in ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"):
        os.environ.setdefault(var, "60")
    args = app_args(tiny_target_dir, pools="serve", cluster_name="dspark-readiness", num_verify_workers=1,
                    num_draft_workers=1, sps_profile=None)
    # a fast CPU prepares the tiny model's cache before the ingress is even routed (seen in CI: the first
    # answer was a 200, no 503 to check); so this test holds the native-kernel build lock of the fresh cache,
    # as a concurrent `make serve` building them would, until it has seen the 503s (or 120 s: then it fails)
    build_lock = contextlib.ExitStack()
    build_lock.enter_context(cache_once.locked("native", root=tmp_path / "cache"))
    lock_held_until = time.monotonic() + 120
    port = free_port("127.0.0.1")
    seen: collections.Counter[str] = collections.Counter()
    bad: list[str] = []
    with front_door_environment("proxy"):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve._run(build_app(args), name="dspark", route_prefix="/", _blocking=False)  # noqa: SLF001 - non-blocking
            first_ready_s = first_chat_s = None
            t0 = time.monotonic()
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                while first_chat_s is None:
                    assert time.monotonic() - t0 < 300, f"no chat answered in 300 s: {dict(seen)} {bad[:3]}"
                    if (seen["/v1/models 503"] and seen["/v1/chat/completions 503"]) \
                            or time.monotonic() > lock_held_until:
                        build_lock.close()  # the warm-up goes on: kernels, GEMM plans, a measured profile
                    is_healthy = _verify_is_healthy()
                    for path in ("/v1/models", "/v1/chat/completions"):
                        try:
                            resp = (client.get(path) if path == "/v1/models" else client.post(path, json=CHAT))
                        except httpx.TransportError:
                            seen["no connection"] += 1
                            continue
                        seen[f"{path} {resp.status_code}"] += 1
                        if resp.status_code == 503:
                            if "retry-after" not in resp.headers or "error" not in resp.json():
                                bad.append(f"{path}: 503 without Retry-After or error body: {resp.text}")
                        elif resp.status_code == 404 and first_ready_s is None and path == "/v1/models" \
                                and "error" not in resp.text:
                            seen["route not yet registered by Serve's proxy"] += 1  # before the app exists
                        elif resp.status_code != 200:
                            bad.append(f"{path}: {resp.status_code} {resp.text[:300]}")
                        elif path == "/v1/models" and first_ready_s is None:
                            first_ready_s = time.monotonic() - t0
                            # ready means ready: the chat right after is answered
                            chat = client.post("/v1/chat/completions", json=CHAT)
                            assert chat.status_code == 200, chat.text
                        elif path == "/v1/chat/completions":
                            first_chat_s = time.monotonic() - t0
                            if first_ready_s is None:  # the pool turned ready between this round's two requests
                                # (the probe's cached "not yet" expired after /v1/models' 503, seen in CI): ready
                                # now, so the models route must say so at once
                                models = client.get("/v1/models")
                                assert models.status_code == 200, models.text
                                first_ready_s = time.monotonic() - t0
                    if is_healthy:  # reported healthy: it answers as soon as the ingress's probe says so, i.e.
                        # within the probe's cache time plus one probe (readiness.py: 1 s + 2 s), 503s till then
                        deadline = time.monotonic() + 3.5
                        while (chat := client.post("/v1/chat/completions", json=CHAT)).status_code == 503:
                            assert "retry-after" in chat.headers, chat.text
                            assert time.monotonic() < deadline, f"verify reported HEALTHY but chat got {chat.text}"
                            time.sleep(0.1)
                        assert chat.status_code == 200, f"verify reported HEALTHY but chat got {chat.text}"
                    time.sleep(0.1)
        finally:
            build_lock.close()
            serve.shutdown()
            ray.shutdown()
    print(f"first /v1/models 200 at {first_ready_s:.1f} s, first chat at {first_chat_s:.1f} s: {dict(seen)}")
    assert not bad, bad
    assert seen["/v1/models 503"] > 0 and seen["/v1/chat/completions 503"] > 0, dict(seen)
    assert first_ready_s is not None and first_ready_s <= first_chat_s + 0.5
