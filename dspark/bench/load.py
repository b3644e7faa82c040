"""Closed-loop load against one OpenAI-compatible base URL: C clients, N streamed chat requests per level.

Every request asks for exactly `max_tokens` tokens (`ignore_eos`), greedy by default, with a fixed seed,
so arms differ only in how fast they produce the same amount of text. Streaming lets us split a
request into TTFT (send → first content chunk) and decode time (first → last chunk). Failed requests
are recorded with their reason and counted, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

Messages = list[dict[str, str]]


@dataclass
class LoadConfig:
    base_url: str
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0  # request i sends seed + i
    model: str | None = None  # None: the server's own model (dspark); vLLM needs its name
    num_requests: int | None = None  # per level; None: max(2 * waves * C, 8); never fewer than C
    # waves of C requests per level and pass (interleaved: per pass): with one, every client sends one request and
    # the level ends with its slowest one; with more, a finished request's client sends the next one, and
    # the level measures continuous batching rather than one batch's drain
    waves: int = 1
    num_warmup: int = 2  # per level (at least one per client, see num_warmup_for), not counted
    timeout_s: float = 600.0
    ignore_eos: bool = True


@dataclass
class RequestRecord:
    ttft_s: float | None = None
    decode_s: float | None = None
    completion_tokens: int | None = None
    num_steps: int | None = None  # None where the server sends no dspark stats
    num_verified: int | None = None
    num_accepted: int | None = None
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list)
    num_warmup_errors: int = 0


def num_requests_for(config: LoadConfig, concurrency: int) -> int:
    num = config.num_requests if config.num_requests is not None else max(2 * config.waves * concurrency, 8)
    return max(num, concurrency)  # fewer would never reach the level's concurrency


def request_body(config: LoadConfig, messages: Messages, index: int, max_tokens: int | None = None) -> dict:
    body: dict[str, Any] = {
        "messages": messages, "max_tokens": max_tokens or config.max_tokens, "temperature": config.temperature,
        "seed": config.seed + index, "stream": True, "ignore_eos": config.ignore_eos,
        # OpenAI servers (vLLM) send usage in streams only when asked; dspark always does
        "stream_options": {"include_usage": True},
        # one user per request: an A/B ingress assigns users to arms, so requests spread over the arms
        "user": f"bench-user-{index}",
    }
    if config.model is not None:
        body["model"] = config.model
    return body


async def stream_one(client: httpx.AsyncClient, body: dict) -> RequestRecord:
    """One streamed chat completion, timed; any failure becomes `error` instead of an exception."""
    rec = RequestRecord()
    t0 = time.perf_counter()
    first_s = last_s = None
    is_done = False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line.removeprefix("data:").strip()
                if payload == "[DONE]":
                    is_done = True
                    break
                event = json.loads(payload)
                if "error" in event:  # reported in-band once headers are sent
                    rec.error = f"stream error: {event['error'].get('message', event['error'])}"
                    return rec
                now = time.perf_counter()
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content") and first_s is None:
                        first_s = now
                    last_s = now
                _read_stats(rec, event)
    # ValueError covers bad JSON and bad bytes; the others, events not shaped like OpenAI's
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return rec
    if not is_done:
        rec.error = "stream ended without [DONE]"
    elif rec.completion_tokens is None:
        rec.error = "stream carried no usage"
    elif first_s is None or last_s is None:
        rec.error = "stream carried no content"
    else:
        rec.ttft_s, rec.decode_s = first_s - t0, last_s - first_s
    return rec


def _read_stats(rec: RequestRecord, event: dict) -> None:
    usage = event.get("usage")
    if usage:
        rec.completion_tokens = int(usage["completion_tokens"])
    stats = event.get("dspark")
    if stats:
        rec.num_steps = int(stats["num_steps"])
        rec.num_verified = int(stats.get("num_verified", 0))
        rec.num_accepted = int(stats.get("num_accepted", 0))


def make_client(config: LoadConfig, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(base_url=config.base_url, timeout=config.timeout_s, limits=limits)


async def run_level(config: LoadConfig, prompts: list[Messages], concurrency: int) -> LevelResult:
    """Warm up (at the level's concurrency), then keep `concurrency` requests in flight until N are done;
    request i uses prompt i."""
    num = num_requests_for(config, concurrency)
    async with make_client(config, concurrency) as client:
        warm_tokens = min(config.max_tokens, 16)
        warm = await asyncio.gather(*(stream_one(client, request_body(config, prompts[i % len(prompts)], i,
                                                                      warm_tokens))
                                      for i in range(num_warmup_for(config, concurrency))))
        records: list[RequestRecord | None] = [None] * num
        next_index = iter(range(num))

        async def client_loop() -> None:
            for i in next_index:  # shared iterator: each index is taken by exactly one client
                records[i] = await stream_one(client, request_body(config, prompts[i % len(prompts)], i))

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall_s = time.perf_counter() - t0
    return LevelResult(concurrency, wall_s, [r for r in records if r is not None],
                       sum(r.error is not None for r in warm))


def num_warmup_for(config: LoadConfig, concurrency: int) -> int:
    """Warm-up requests before a level (or an interleaved pass): `num_warmup`, but at least one per client
    (0 turns it off), so every arm's turn starts with its whole batch loaded once and the first batch of
    a new size (its buffers, its kernels' first calls) is not in the figures."""
    return max(config.num_warmup, concurrency) if config.num_warmup > 0 else 0


def run_level_sync(config: LoadConfig, prompts: list[Messages], concurrency: int) -> LevelResult:
    return asyncio.run(run_level(config, prompts, concurrency))


def merge_levels(parts: list[LevelResult]) -> LevelResult:
    """Passes of one level run at different times, as one: their records, and their wall times summed
    (so the merged throughput is all tokens over all time spent loaded)."""
    if not parts or len({p.concurrency for p in parts}) != 1:
        raise ValueError("merge_levels needs at least one pass, all at one concurrency")
    return LevelResult(parts[0].concurrency, sum(p.wall_s for p in parts), [r for p in parts for r in p.records],
                       sum(p.num_warmup_errors for p in parts))


def fetch_server_stats(base_url: str, timeout_s: float = 30.0) -> dict | None:
    """GET /v1/dspark/stats when the server has it (200 and JSON); None otherwise, silently."""
    try:
        resp = httpx.get(f"{base_url}/v1/dspark/stats", timeout=timeout_s)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def output_throughput(level: LevelResult) -> float:
    """Tokens of the requests that succeeded, per second of the level's wall time."""
    tokens = sum(r.completion_tokens or 0 for r in level.records if r.error is None)
    return tokens / level.wall_s if level.wall_s > 0 else 0.0


def tps_user_of(rec: RequestRecord) -> float | None:
    """What its user saw: tokens after the first per second of decoding; None for a failed or one-token request."""
    if rec.error is not None or not rec.decode_s or not rec.completion_tokens or rec.completion_tokens < 2:
        return None
    return (rec.completion_tokens - 1) / rec.decode_s


def summarize_level(level: LevelResult, max_tokens: int, keep_requests: bool = False) -> dict:
    """The per-level figures; spec figures (τ, verification length) only from requests that report them."""
    ok = [r for r in level.records if r.error is None]
    errors = [r.error for r in level.records if r.error is not None]
    tps_user = [t for t in map(tps_user_of, ok) if t is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    spec = [r for r in ok if r.num_steps]
    num_steps = sum(r.num_steps or 0 for r in spec)
    out: dict[str, Any] = {
        "concurrency": level.concurrency,
        "num_requests": len(level.records),
        "num_errors": len(errors),
        "errors": sorted(set(errors))[:5],
        "num_warmup_errors": level.num_warmup_errors,
        "num_wrong_length": sum(r.completion_tokens != max_tokens for r in ok),
        "wall_s": level.wall_s,
        "output_throughput_tok_s": output_throughput(level),
        "request_throughput_req_s": len(ok) / level.wall_s if level.wall_s > 0 else 0.0,
        "tps_user_median": statistics.median(tps_user) if tps_user else None,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "decode_p50_s": _percentile([r.decode_s for r in ok if r.decode_s is not None], 50),
        # τ: tokens per verification step, bonus token included
        "tau": _ratio(sum(r.completion_tokens or 0 for r in spec), num_steps),
        "mean_verify_len": _ratio(sum(r.num_verified or 0 for r in spec), num_steps),
        "acceptance_rate": _ratio(sum(r.num_accepted or 0 for r in spec), sum(r.num_verified or 0 for r in spec)),
    }
    if keep_requests:
        out["requests"] = [asdict(r) for r in level.records]
    return out
