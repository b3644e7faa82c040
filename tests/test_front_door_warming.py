"""Before Serve has routed the application, HAProxy answers the API paths 503 + Retry-After (warming up), not the
404 of the config Ray generates; other paths are left alone; and so it does once the application is routed while its
backend has never had a replica (only Serve's proxy, a backup that would hold the request until one comes). A real
HAProxy serves the patched config."""

from __future__ import annotations

import httpx

from dspark.actors.transport import free_port
from dspark.cluster.ingress.front_door_rules import MARKER, add_rules, patch_file
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


# routed, before the ingress replica is up: the backend holds only Serve's proxy, as a backup server
STARTING = HEAD + """    acl is_app path_beg /
    use_backend app if is_app
backend app
    server proxy 127.0.0.1:{proxy_port} check backup
"""
UP = STARTING + "    server replica 127.0.0.1:{replica_port} check\n"


def test_a_routed_backend_is_warming_up_until_its_first_replica_and_not_after(tmp_path):
    port, proxy_port, replica_port = (free_port("127.0.0.1") for _ in range(3))
    path = tmp_path / "haproxy.cfg"
    warming = "has no replica yet"

    def patched(template: str) -> str:
        path.write_text(template.format(port=port, maxconn=100, timeout="5s", proxy_port=proxy_port,
                                        replica_port=replica_port))
        patch_file(str(path))
        return path.read_text()

    config = patched(STARTING)
    assert warming in config
    (tmp_path / "run").mkdir()
    with real_haproxy(config, tmp_path / "run"):
        chat = first_answer(lambda: httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}, timeout=2))
        assert chat.status_code == 503 and chat.headers["retry-after"] == "2"
        assert chat.json()["error"]["code"] == "warming_up"
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # not ready while the API is refused
        assert health.status_code == 503 and health.headers["retry-after"] == "2"
    assert warming not in patched(UP)  # a replica is up: the rules as for any routed backend
    assert (tmp_path / "dspark_replica_seen_app").exists()
    # its replicas gone later (one died): Serve's proxy takes the requests until a replacement comes, as Ray meant
    again = patched(STARTING)
    assert MARKER in again and warming not in again
