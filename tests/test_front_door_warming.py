"""Before Serve has routed the application, HAProxy answers the API paths 503 + Retry-After (warming up), not the
404 of the config Ray generates; other paths are left alone. A real HAProxy serves the patched config."""

from __future__ import annotations

import httpx

from dspark.actors.transport import free_port
from dspark.cluster.ingress.front_door_rules import MARKER, add_rules
from tests.real_haproxy import HEAD, first_answer, needs_haproxy, real_haproxy

pytestmark = needs_haproxy

# the shape of Ray Serve's generated config before any application is routed: no use_backend lines
NO_APP = HEAD + """    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain string "Path not found"
"""


def test_haproxy_answers_the_api_503_with_retry_after_until_an_application_is_routed(tmp_path):
    port = free_port("127.0.0.1")
    config = add_rules(NO_APP.format(port=port, maxconn=100, timeout="5s"))
    assert MARKER in config and add_rules(config) == config  # idempotent, like the rules for routed backends
    with real_haproxy(config, tmp_path):
        resp = first_answer(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "2"
        assert resp.json()["error"]["code"] == "warming_up"
        chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}, timeout=2)
        assert chat.status_code == 503 and "retry-after" in chat.headers
        assert httpx.get(f"http://127.0.0.1:{port}/elsewhere", timeout=2).status_code == 404
