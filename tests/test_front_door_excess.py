"""Past the limit the ingress publishes, a real HAProxy lets a few requests a second through to admission (the
demand it counts for the autoscaler) and answers the rest itself, however fast the backend refuses them. Before,
a slack of requests in flight was refilled as fast as the ingress refused: on an idle test cluster 21 % and 88 % of
the refusals in a burst of 2,000 came from Python."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from dspark.actors.transport import free_port
from dspark.cluster.ingress.front_door_rules import LIMIT_HEADER, RETRY_HEADER, add_rules
from tests.real_haproxy import HEAD, first_answer, needs_haproxy, real_haproxy

pytestmark = needs_haproxy

# the shape of Ray Serve's generated config once an application is routed
ROUTED = HEAD + """    acl is_app path_beg /
    use_backend app if is_app
backend app
    server s1 127.0.0.1:{backend_port}
"""
EXCESS_PER_S = 3


class _Ingress(BaseHTTPRequestHandler):
    """An ingress that admits one request in flight (it publishes limit 1), holds a request whose prompt asks
    for it, and refuses the rest at once, as admission does."""
    lock = threading.Lock()
    reached: list[float] = []
    in_flight = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        cls = type(self)
        with cls.lock:
            cls.reached.append(time.monotonic())
            admitted = cls.in_flight == 0
            cls.in_flight += admitted
        try:
            if admitted and b"hold" in body:
                time.sleep(3.0)
            status = 200 if admitted else 429
            payload = b'{"ok": true}' if admitted else b'{"error": {"message": "at capacity"}}'
            self.send_response(status)
            self.send_header(LIMIT_HEADER, "1")
            self.send_header(RETRY_HEADER, "1")
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        finally:
            with cls.lock:
                cls.in_flight -= admitted

    def log_message(self, *args: object) -> None:
        pass


def test_past_the_limit_the_front_door_lets_a_few_requests_a_second_through_and_refuses_the_rest(tmp_path):
    backend = ThreadingHTTPServer(("127.0.0.1", 0), _Ingress)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    port = free_port("127.0.0.1")
    config = add_rules(ROUTED.format(port=port, backend_port=backend.server_address[1], maxconn=4000,
                                     timeout="30s"), EXCESS_PER_S)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        with real_haproxy(config, tmp_path):
            # the first response tells HAProxy the limit (and is stripped of it)
            first = first_answer(lambda: httpx.post(url, json={"prompt": "hi"}, timeout=5))
            assert first.status_code == 200 and LIMIT_HEADER not in first.headers
            hold = threading.Thread(target=lambda: httpx.post(url, json={"prompt": "hold"}, timeout=10))
            hold.start()
            while not _Ingress.in_flight:
                time.sleep(0.01)
            _Ingress.reached.clear()
            start = time.monotonic()
            responses = []
            with httpx.Client(timeout=5) as client:
                while time.monotonic() - start < 2.0:  # ~2 s of requests, one at a time, past the limit
                    responses.append(client.post(url, json={"prompt": "more"}))
            elapsed = time.monotonic() - start
            hold.join()
    finally:
        backend.shutdown()
    by_door = [r for r in responses if r.headers.get("x-dspark-refused-by") == "front-door"]
    assert all(r.status_code == 429 for r in responses)
    assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["message"] for r in by_door)
    reached = len(_Ingress.reached)  # each refused by the ingress (at its limit), so it counted the demand
    # a one-second rate window: at most EXCESS_PER_S in any second, and at least that many in the first
    print(f"past the limit: {len(responses)} requests in {elapsed:.1f} s, {reached} reached the ingress")
    assert EXCESS_PER_S <= reached <= EXCESS_PER_S * (int(elapsed) + 2), (reached, elapsed)
    assert len(by_door) == len(responses) - reached and len(by_door) > 10 * reached, (len(by_door), reached)
