"""The real Ray Serve app over HTTP (loopback) with the tiny model: OpenAI routes, streaming, errors."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from transformers import AutoTokenizer

from dspark.actors.transport import free_port
from dspark.cluster.app import ServeAppConfig, build_app
from dspark.cluster.ingress.front_door import front_door_environment

MODEL = "tiny"
PROMPT = "the cat and the dog"
MAX_MODEL_LEN = 256


@contextlib.contextmanager
def serving(args: dict, health_timeout_s: float = 60, headers: dict | None = None,
            front_door: str = "proxy") -> Iterator[httpx.Client]:
    """A local Ray cluster with the dspark app built from `args`, and an HTTP client on it (through Serve's
    proxy unless `front_door` says otherwise)."""
    port = free_port("127.0.0.1")
    # a 2-core machine running other work can starve the proxy for a while: be patient with it
    # (the controller inherits these through the local cluster's environment)
    for var in ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"):
        os.environ.setdefault(var, "60")
    with front_door_environment(front_door):  # type: ignore[arg-type]
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(args), name="dspark", route_prefix="/")
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=max(60, health_timeout_s),
                              headers=headers) as client:
                _wait_healthy(client, health_timeout_s)
                yield client
        finally:
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def server(tiny_target_dir: Path) -> Iterator[httpx.Client]:
    with serving({"target": str(tiny_target_dir), "model_name": MODEL, "drafter": "ngram", "scheduler": "fixed",
                  "num_draft_tokens": 4, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8,
                  "num_threads": 1}) as client:
        yield client


def _wait_healthy(client: httpx.Client, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not become healthy")


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def _sse_events(client: httpx.Client, path: str, body: dict) -> list[dict | str]:
    """POST with stream=True; every `data:` payload, JSON-decoded except the final [DONE]."""
    events: list[dict | str] = []
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _greedy(**extra: object) -> dict:
    return {"model": MODEL, "temperature": 0, "ignore_eos": True, **extra}


def test_models_lists_the_served_name(server: httpx.Client) -> None:
    resp = server.get("/v1/models")
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == [MODEL]


def test_completion_generates_exactly_max_tokens_and_counts_usage(server: httpx.Client, tokenizer) -> None:
    resp = server.post("/v1/completions", json=_greedy(prompt=PROMPT, max_tokens=24))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"]
    usage = body["usage"]
    assert usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == len(tokenizer(PROMPT)["input_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24
    assert body["dspark"]["num_steps"] >= 1


def test_inline_stats_show_the_steps_that_served_a_completion(server: httpx.Client) -> None:
    before = server.get("/v1/dspark/stats").json()["workers"]["inline"]["num_steps"]
    assert server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                "temperature": 0}).status_code == 200
    stats = server.get("/v1/dspark/stats").json()
    inline = stats["workers"]["inline"]
    assert stats["mode"] == "inline" and inline["num_steps"] > before and inline["num_running"] == 0
    last = inline["timeline"][-1]
    assert last["end_s"] >= last["start_s"] and last["num_tokens"] >= last["num_requests"] >= 1
    assert sum(s["num_tokens"] for s in inline["timeline"][-(inline["num_steps"] - before):]) >= 12


def test_completion_accepts_token_id_prompt(server: httpx.Client) -> None:
    resp = server.post("/v1/completions", json=_greedy(prompt=[4, 35, 5], max_tokens=5))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_streamed_completion_concatenates_to_the_non_streamed_text(server: httpx.Client) -> None:
    request = _greedy(prompt=PROMPT, max_tokens=40)
    full = server.post("/v1/completions", json=request).json()
    events = _sse_events(server, "/v1/completions", request)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(isinstance(c, dict) and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == full["usage"]
    assert len({c["id"] for c in chunks}) == 1


def test_chat_completion_streamed_and_not_agree(server: httpx.Client) -> None:
    request = _greedy(messages=[{"role": "system", "content": "math"},
                                {"role": "user", "content": "one two three"}], max_tokens=30)
    resp = server.post("/v1/chat/completions", json=request)
    assert resp.status_code == 200, resp.text
    full = resp.json()
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["role"] == "assistant"
    assert full["usage"]["completion_tokens"] == 30
    events = _sse_events(server, "/v1/chat/completions", request)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == full["usage"]


def test_stop_string_cuts_the_text_before_it(server: httpx.Client) -> None:
    full = server.post("/v1/completions", json=_greedy(prompt=PROMPT, max_tokens=40)).json()
    text = full["choices"][0]["text"]
    words = text.split()
    assert len(words) > 4, text
    stop = " " + words[4]  # a later word; the text must end right before its first occurrence
    expected = text[:text.find(stop)]
    request = _greedy(prompt=PROMPT, max_tokens=40, stop=[stop, "never-generated"])
    cut = server.post("/v1/completions", json=request).json()
    assert cut["choices"][0]["text"] == expected
    assert cut["choices"][0]["finish_reason"] == "stop"
    events = _sse_events(server, "/v1/completions", request)
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("path", "body", "reason"), [
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2}, "n=1"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}, "max_model_len"),
    ("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 1)}, "max_model_len"),
    ("/v1/completions", {"prompt": [10**9]}, "token ids"),
    ("/v1/completions", {"prompt": ""}, "empty"),
])
def test_bad_request_is_400_with_a_reason(server: httpx.Client, path: str, body: dict, reason: str) -> None:
    resp = server.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert reason in error["message"]


def test_malformed_json_is_400(server: httpx.Client) -> None:
    resp = server.post("/v1/completions", content=b'{"prompt": "the cat",',
                       headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert "malformed JSON" in resp.json()["error"]["message"]


def test_unknown_model_is_404(server: httpx.Client) -> None:
    resp = server.post("/v1/completions", json={"model": "gpt-9", "prompt": PROMPT})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


def test_unknown_fields_are_ignored(server: httpx.Client) -> None:
    resp = server.post("/v1/completions", json=_greedy(prompt=PROMPT, max_tokens=3, user="x", logprobs=None,
                                                        stream_options={"include_usage": True}))
    assert resp.status_code == 200, resp.text


def test_serve_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="drafter_kwarg"):
        ServeAppConfig.model_validate({"drafter_kwarg": {}})
