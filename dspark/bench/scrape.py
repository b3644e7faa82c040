"""What a running server says about itself: sums of its Prometheus series (`/metrics`) and its pools'
draft links (`/v1/dspark/stats`)."""

from __future__ import annotations

import time

import httpx

HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting", "dspark_draft_contexts")


def draft_links(base_url: str, headers: dict[str, str]) -> dict | None:
    """Serve pools of the first arm (what `/v1/dspark/stats` reports): verify replicas, and how many of them
    have no working draft link. None where there are no Serve pools to ask."""
    try:
        resp = httpx.get(f"{base_url}/v1/dspark/stats", headers=headers, timeout=30)
        verify = ((resp.json().get("scheduler") or {}).get("replicas") or {}).get("verify") if resp.is_success else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not verify:
        return None
    return {"verify_replicas": len(verify), "broken": sum(1 for v in verify.values() if v.get("draft_broken"))}


def engine_leftovers(base_url: str, headers: dict[str, str], timeout_s: float = 45.0) -> dict:
    """Requests the engines still hold once every client has its answer (0 running, 0 waiting, 0 draft
    contexts expected), from /metrics; polled, since the metrics agents export every few seconds."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, float] = {}
    while True:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
        out = {name: metric_sum(text, name) for name in HELD}
        if not any(out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def counter(base_url: str, headers: dict[str, str], name: str, label: str) -> float:
    """The sum of a counter's series carrying `label`, from /metrics."""
    return metric_sum(httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text, name, label)


def metric_sum(text: str, name: str, label: str = "") -> float:
    """The sum over the series of metric `name` (those carrying `label`) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
