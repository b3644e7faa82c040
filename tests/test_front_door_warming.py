"""Before Serve has routed the application, HAProxy answers the API paths 503 + Retry-After (warming up), not the
404 of the config Ray generates; other paths are left alone. A real HAProxy serves the patched config."""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest

from dspark.actors.transport import free_port
from dspark.cluster.ingress.front_door import haproxy_binary
from dspark.cluster.ingress.front_door_rules import MARKER, add_rules

pytestmark = pytest.mark.skipif(haproxy_binary() is None and not os.environ.get("DSPARK_REQUIRE_HAPROXY"),
                                reason="Debian package `haproxy` is not installed (apt-get install haproxy)")

# the shape of Ray Serve's generated config before any application is routed: no use_backend lines
NO_APP = """global
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 5s
    timeout server 5s
frontend http_frontend
    bind 127.0.0.1:{port}
    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain string "Path not found"
"""


def test_haproxy_answers_the_api_503_with_retry_after_until_an_application_is_routed(tmp_path):
    port = free_port("127.0.0.1")
    config = add_rules(NO_APP.format(port=port))
    assert MARKER in config and add_rules(config) == config  # idempotent, like the rules for routed backends
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    binary = haproxy_binary()
    assert subprocess.run([binary, "-c", "-f", str(path)], capture_output=True).returncode == 0
    proc = subprocess.Popen([binary, "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "haproxy did not start"
                time.sleep(0.1)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "2"
        assert resp.json()["error"]["code"] == "warming_up"
        chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}, timeout=2)
        assert chat.status_code == 503 and "retry-after" in chat.headers
        assert httpx.get(f"http://127.0.0.1:{port}/elsewhere", timeout=2).status_code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=10)
