"""Per-key quotas: a key over its quota gets 429 with OpenAI's rate-limit headers while another key is served;
keys without a quota carry no such headers; the settled buckets live in a named actor, so a restarted ingress
replica reads them back instead of starting full."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import ray

from dspark.cluster.ingress.access import KeyRing, key_digest
from dspark.cluster.ingress.admission import Admission
from dspark.cluster.ingress.quota_board import board_handle
from dspark.cluster.ingress.quotas import QuotaBook, duration_text
from dspark.cluster.ingress.routes import build_fastapi
from dspark.config.engine import EngineConfig
from dspark.verify_service.async_engine import AsyncEngine
from dspark.verify_service.engine import Engine
from tests.test_http_guards import _uvicorn

LIMITED, OTHER, FREE = "key-with-quota-1", "key-with-quota-2", "key-without-quota"
BODY = {"model": "tiny", "prompt": [5, 9, 11], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_buckets_refuse_past_the_quota_and_say_when_they_refill() -> None:
    book = QuotaBook({key_digest(LIMITED): (2.0, 100.0)})
    d = key_digest(LIMITED)
    assert book.check(key_digest(FREE)) is None  # no quota: not counted at all
    first = book.check(d)
    assert first is not None and first.is_allowed
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    assert book.check(d).is_allowed
    refused = book.check(d)
    assert not refused.is_allowed and refused.retry_after_s >= 1 and "requests" in refused.reason
    book.buckets[d].requests.level = 5  # (as if a minute passed)
    book.charge_tokens(d, 150)  # a request's prompt + completion, charged at its end: a debt
    refused = book.check(d)
    assert not refused.is_allowed and "tokens" in refused.reason
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert duration_text(90) == "1m30s" and duration_text(6) == "6s" and duration_text(0.25) == "250ms"


@pytest.fixture(scope="module")
def quota_server(tiny_target) -> Iterator[str]:  # noqa: ANN001
    engine = AsyncEngine(Engine(EngineConfig(target=str(tiny_target.path), drafter="ngram", scheduler="fixed",
                                             num_draft_tokens=3, max_num_seqs=4, max_model_len=128),
                                target=tiny_target))
    keys = KeyRing([key_digest(k) for k in (LIMITED, OTHER, FREE)], [])
    quotas = QuotaBook({key_digest(LIMITED): (3.0, None), key_digest(OTHER): (3.0, 10_000.0)})
    app = build_fastapi(lambda: engine, "tiny", keys=keys, admission=Admission(4, 4), quotas=quotas)
    with _uvicorn(app) as url:
        yield url
    engine.shutdown()


def test_a_key_over_its_quota_gets_429_with_rate_limit_headers_and_another_key_is_unaffected(
        quota_server: str) -> None:
    def post(key: str) -> httpx.Response:
        return httpx.post(f"{quota_server}/v1/completions", json=BODY, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})

    ok = [post(LIMITED) for _ in range(3)]
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in ok] == ["2", "1", "0"]
    over = post(LIMITED)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "rate_limit_exceeded" and "rate limit" in over.json()["error"]["message"]
    assert int(over.headers["retry-after"]) >= 1
    for name in ("remaining-requests", "limit-requests", "reset-requests"):
        assert f"x-ratelimit-{name}" in over.headers, over.headers
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    other = post(OTHER)  # its own bucket: untouched by the first key's
    assert other.status_code == 200 and other.headers["x-ratelimit-remaining-requests"] == "2"
    assert int(other.headers["x-ratelimit-remaining-tokens"]) <= 10_000
    assert other.headers["x-ratelimit-reset-tokens"].endswith("s")
    free = [post(FREE) for _ in range(5)]  # no quota: never limited, no rate-limit headers
    assert all(r.status_code == 200 and "x-ratelimit-remaining-requests" not in r.headers for r in free)


def test_the_settled_quota_outlives_an_ingress_replica() -> None:
    """Two books stand for an ingress replica before and after its restart: the second reads the first's
    spending back from the board."""
    digest = key_digest(LIMITED)
    limits = {digest: (10.0, None)}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        before = QuotaBook(limits)
        for _ in range(7):
            assert before.check(digest).is_allowed
        board = board_handle("dspark-quota-test")
        ray.get(board.settle.remote(before.limits, before.take_used()))
        after = QuotaBook(limits)  # a fresh replica: full buckets until it settles
        after.adopt(asyncio.run(_settle(board, after)))
        assert after.buckets[digest].requests.level == pytest.approx(3.0, abs=0.1)
        ray.kill(board)
    finally:
        ray.shutdown()


async def _settle(board, book: QuotaBook) -> dict:  # noqa: ANN001
    return await board.settle.remote(book.limits, book.take_used())
