"""`dspark bench overload`: N× the cluster's admission limit at once, over loopback, bounded in count and time.

Starts the app of a serve config on a local Ray cluster, sends `multiple × limit` chat completions at once
(limit = what the ingress admits: each arm's batch capacity plus its queue bound), and reports: how many
were admitted and completed, how many were refused with 429/503 + Retry-After and how fast, any other
status, the latency of admitted requests, and the resident memory of every process of the Ray session
(sampled throughout) against a stated bound. Afterwards the engines must hold no request (no leaked KV
slot or draft context). JSON last.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from dspark.bench.serve_bench import free_port, wait_healthy


def _session_rss_mb() -> float:
    """RSS of this process and every Ray process on the machine (raylet, GCS, workers, replicas)."""
    total = psutil.Process().memory_info().rss
    for proc in psutil.process_iter(["name", "cmdline", "memory_info"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.pid != psutil.Process().pid and ("ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd
                                                     or "ray/_private" in cmd or "ray/dashboard" in cmd):
                total += proc.info["memory_info"].rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return total / 2**20


class _RssSampler:
    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s, self.samples = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(_session_rss_mb())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _fire(base_url: str, num: int, max_tokens: int, headers: dict[str, str], timeout_s: float) -> list[dict]:
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=num)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, headers=headers) as client:
        async def one(i: int) -> dict:
            body = {"messages": [{"role": "user", "content": f"Count from {i % 50} to {i % 50 + 9}."}],
                    "max_tokens": max_tokens, "temperature": 0, "user": f"overload-{i}"}
            t0 = time.perf_counter()
            try:
                resp = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                return {"status": None, "latency_s": time.perf_counter() - t0, "error": type(exc).__name__}
            rec = {"status": resp.status_code, "latency_s": time.perf_counter() - t0,
                   "retry_after": resp.headers.get("retry-after")}
            if resp.status_code >= 400:
                try:
                    rec["reason"] = resp.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    rec["reason"] = None
            return rec

        return await asyncio.gather(*(one(i) for i in range(num)))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_overload(args: dict[str, Any], multiple: float = 10.0, max_tokens: int = 16,
                 rss_bound_mb: float | None = None, timeout_s: float = 300.0,
                 headers: dict[str, str] | None = None) -> dict:
    import ray
    from ray import serve

    from dspark.cluster.app import build_app
    from dspark.cluster.config import ServeAppConfig

    cfg = ServeAppConfig.model_validate(args)
    limit = cfg.num_replicas * (cfg.capacity + cfg.max_queued_requests * max(1, len(cfg.ab_arms)))
    num = int(round(multiple * limit))
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="dspark", route_prefix="/")
        wait_healthy(base_url, 900)
        # warm-up: one request per arm's worth, so first-request costs are not in the figures
        asyncio.run(_fire(base_url, 4, max_tokens, headers or {}, timeout_s))
        rss_before = _session_rss_mb()
        bound = rss_bound_mb if rss_bound_mb is not None else rss_before + 512.0
        t0 = time.perf_counter()
        with _RssSampler() as rss:
            records = asyncio.run(_fire(base_url, num, max_tokens, headers or {}, timeout_s))
        wall_s = time.perf_counter() - t0
        leftover = _engine_leftovers(base_url, headers or {})
        rss_after = _session_rss_mb()
    finally:
        serve.shutdown()
        ray.shutdown()
    ok = [r for r in records if r["status"] == 200]
    refused = [r for r in records if r["status"] in (429, 503)]
    other = [r for r in records if r["status"] not in (200, 429, 503)]
    refused_s = [r["latency_s"] for r in refused]
    ok_s = [r["latency_s"] for r in ok]
    return {
        "bench": "overload", "admission_limit": limit, "multiple": multiple, "num_sent": num,
        "max_tokens": max_tokens, "wall_s": round(wall_s, 3),
        "num_admitted_ok": len(ok), "num_refused": len(refused),
        "num_refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
        "num_refused_with_reason": sum(1 for r in refused if r.get("reason")),
        "num_other": len(other), "other_statuses": sorted({str(r["status"]) for r in other}),
        "num_5xx_other_than_503": sum(1 for r in records if (r["status"] or 0) >= 500 and r["status"] != 503),
        "refusal_latency_ms": {"p50": _ms(_pct(refused_s, 0.5)), "p99": _ms(_pct(refused_s, 0.99)),
                               "max": _ms(max(refused_s) if refused_s else None)},
        "admitted_latency_s": {"p50": _pct(ok_s, 0.5), "p99": _pct(ok_s, 0.99), "max": max(ok_s) if ok_s else None,
                               "mean": statistics.fmean(ok_s) if ok_s else None},
        "rss_mb": {"before": round(rss_before, 1), "peak": round(max(rss.samples, default=rss_before), 1),
                   "after": round(rss_after, 1), "bound": round(bound, 1),
                   "within_bound": max(rss.samples, default=rss_before) <= bound},
        "engines_after": leftover,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1e3 * value, 2)


_HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting", "dspark_draft_contexts")


def _engine_leftovers(base_url: str, headers: dict[str, str], timeout_s: float = 45.0) -> dict:
    """Requests the engines still hold once every client has its answer (0 running, 0 waiting, 0 draft
    contexts expected), from /metrics; polled, since the metrics agents export every few seconds."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, float] = {}
    while True:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
        out = dict.fromkeys(_HELD, 0.0)
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        if not any(out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(2.0)


def load_serve_args(path: Path, app_name: str | None = None) -> dict:
    """The `args` of an application of a Serve config file (the first one, or `app_name`)."""
    import yaml

    apps = yaml.safe_load(path.read_text())["applications"]
    app = next((a for a in apps if app_name in (None, a.get("name"))), None)
    if app is None:
        raise ValueError(f"{path}: no application named {app_name!r}")
    return dict(app.get("args") or {})
