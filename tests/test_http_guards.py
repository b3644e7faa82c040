"""The HTTP front under bad input, missing keys and overload: a real uvicorn server on loopback over the
tiny model's real engine. Nothing here may answer 5xx to a client's mistake or leak internals."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.actors.transport import free_port
from dspark.cluster.ingress.access import KeyRing, key_digest
from dspark.cluster.ingress.admission import Admission
from dspark.cluster.ingress.routes import build_fastapi
from dspark.config.engine import EngineConfig
from dspark.verify_service.async_engine import AsyncEngine
from dspark.verify_service.engine import Engine

MODEL = "tiny"
USER_KEY, ADMIN_KEY = "user-key-0123", "admin-key-4567"
MAX_BODY = 64 * 1024
CAPACITY, QUEUE = 2, 2
# what an error body must never contain: tracebacks, file paths, addresses, actor ids
LEAKS = re.compile(r"Traceback|File \"|/work/|/root/|/home/|site-packages|\.py\b|\b\d{1,3}(\.\d{1,3}){3}\b|"
                   r"ActorID|actor_id|pid=", re.I)


@contextlib.contextmanager
def _uvicorn(app) -> Iterator[str]:  # noqa: ANN001
    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def guarded(tiny_target) -> Iterator[tuple[str, Admission]]:
    engine = AsyncEngine(Engine(EngineConfig(target=str(tiny_target.path), drafter="ngram", scheduler="fixed",
                                             num_draft_tokens=3, max_num_seqs=CAPACITY, max_model_len=128),
                                target=tiny_target))
    admission = Admission(CAPACITY, QUEUE)
    keys = KeyRing([key_digest(USER_KEY)], [key_digest(ADMIN_KEY)])
    app = build_fastapi(lambda: engine, MODEL, keys=keys, admission=admission, max_body_bytes=MAX_BODY)
    with _uvicorn(app) as url:
        yield url, admission
    engine.shutdown()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _client(url: str, key: str | None = USER_KEY) -> httpx.Client:
    return httpx.Client(base_url=url, headers=_auth(key) if key else {}, timeout=60)


ROUTES = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/v1/dspark/stats"), ("GET", "/docs"),
          ("GET", "/openapi.json"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("GET", "/no/such/route")]


def test_every_route_needs_a_key_and_admin_routes_need_an_admin_key(guarded) -> None:
    url, _ = guarded
    for method, path in ROUTES:
        for key in (None, "wrong-key"):
            resp = _client(url, key).request(method, path, json={})
            assert resp.status_code == 401, (method, path, key, resp.status_code)
            assert resp.headers["www-authenticate"] == "Bearer" and resp.json()["error"]["message"]
    assert _client(url, USER_KEY).get("/v1/dspark/stats").status_code == 403
    stats = _client(url, ADMIN_KEY).get("/v1/dspark/stats")  # admitted: the inline engine's own stats
    assert stats.status_code == 200 and stats.json()["mode"] == "inline"
    assert _client(url, USER_KEY).get("/v1/models").status_code == 200
    assert _client(url, ADMIN_KEY).get("/v1/models").status_code == 200  # admin keys are user keys too


def test_bodies_over_the_limit_are_413_announced_or_chunked(guarded) -> None:
    url, _ = guarded
    big = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY + 10)})
    with _client(url) as c:
        assert c.post("/v1/completions", content=big, headers={"content-type": "application/json"}).status_code == 413

        def chunks() -> Iterator[bytes]:  # no Content-Length: transfer-encoding chunked
            for i in range(0, len(big), 4096):
                yield big[i:i + 4096].encode()

        resp = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert resp.status_code == 413 and "bytes" in resp.json()["error"]["message"]


@pytest.mark.parametrize("extra", [{"presence_penalty": 0.5},
                                   {"logit_bias": {"5": 10}}, {"tools": [{"type": "function"}]},
                                   {"response_format": {"type": "json_object"}}, {"echo": True}])
def test_fields_that_would_change_the_output_are_refused_not_ignored(guarded, extra) -> None:
    url, _ = guarded
    with _client(url) as c:
        for path, body in (("/v1/completions", {"prompt": "the cat"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            resp = c.post(path, json={"model": MODEL, "max_tokens": 4, **body, **extra})
            assert resp.status_code == 400, (path, extra, resp.text)
            assert next(iter(extra)) in resp.json()["error"]["message"]


def test_neutral_values_of_those_fields_are_accepted(guarded) -> None:
    url, _ = guarded
    with _client(url) as c:
        resp = c.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "logprobs": False,
            "top_logprobs": 0,
            "presence_penalty": 0, "response_format": {"type": "text"}, "user": "u-1", "stream_options": {}})
        assert resp.status_code == 200, resp.text


def test_overload_is_refused_at_once_with_retry_after_and_admitted_requests_finish(guarded) -> None:
    url, admission = guarded
    num = 12  # three times what the server admits (capacity 2 + queue 2)

    def one(_: int) -> tuple[int, float, str | None]:
        with _client(url) as c:
            t0 = time.perf_counter()
            resp = c.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 100,
                                                   "ignore_eos": True, "temperature": 0})
            return resp.status_code, time.perf_counter() - t0, resp.headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        results = list(pool.map(one, range(num)))
    codes = [code for code, _, _ in results]
    assert set(codes) <= {200, 429} and codes.count(200) >= CAPACITY + QUEUE and 429 in codes
    assert all(int(ra) >= 1 for code, _, ra in results if code == 429)
    assert admission.num_in_flight == 0 and admission.num_rejected >= codes.count(429)  # no ticket leaked


_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
           "stop", "stream", "n", "ignore_eos", "logprobs", "user", "role", "content"]
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                     | st.text(max_size=40), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=8), inner, max_size=5),
                     max_leaves=12)
_BODY = st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=7)
_RAW = st.binary(max_size=200) | st.text(max_size=100).map(str.encode)  # broken UTF-8, control characters


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=_BODY | _BODY.map(lambda b: {**b, "model": MODEL, "max_tokens": 3}) | _RAW)
def test_fuzzed_bodies_never_get_a_5xx_or_a_leak(guarded, path, body) -> None:
    url, _ = guarded
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with _client(url) as c:
        resp = c.post(path, content=content, headers={"content-type": "application/json"})
    assert resp.status_code < 500, (body, resp.status_code, resp.text)
    if resp.status_code >= 400:
        assert resp.json()["error"]["message"]  # a reason, OpenAI-style
        assert not LEAKS.search(resp.text), resp.text


def test_logprobs_come_back_in_openai_formats_for_chat_and_completions(guarded) -> None:
    url, _ = guarded
    with _client(url) as c:
        chat = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]}).json()
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == chat["usage"]["completion_tokens"] == 6
        assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
        assert all(t["logprob"] == pytest.approx(t["top_logprobs"][0]["logprob"]) for t in content)  # greedy
        comp = c.post("/v1/completions", json={"model": MODEL, "max_tokens": 5, "prompt": "the cat",
                                               "ignore_eos": True, "logprobs": 1}).json()
        lp = comp["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
        assert lp["text_offset"][0] == 0
        events = []
        with c.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
                "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        streamed = [t for e in events for t in (e["choices"][0]["logprobs"] or {}).get("content", [])]
        assert [t["logprob"] for t in streamed] == pytest.approx([t["logprob"] for t in content])
