"""A real Prometheus (Debian's `prometheus`) scrapes `/metrics` of a real cluster under load (tiny model,
decoupled pools, gloo, central scheduler, the hybrid drafter: DSpark with its confidence head + the suffix
sources), and every PromQL query of every Grafana panel returns data. Also: the vLLM names are there, and
`/metrics` needs an admin key."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dspark.actors.transport import free_port
from dspark.cluster.ingress.access import key_digest
from dspark.metrics.dashboards import all_queries
from tests.test_cluster_serving import app_args
from tests.test_serve_autoscaling import AUTOSCALING_POLICY, deployed
from tests.tiny_drafters import save_tiny_baseline

PROMETHEUS = shutil.which("prometheus")
ADMIN = "sk-admin-prom"
pytestmark = pytest.mark.skipif(PROMETHEUS is None and not os.environ.get("DSPARK_REQUIRE_PROMETHEUS"),
                                reason="Debian package `prometheus` is not installed (apt-get install prometheus); "
                                ".ci/run installs it and requires it")

VLLM_NAMES = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
              "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
              "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total"]


@contextlib.contextmanager
def prometheus(target: str, tmp: Path) -> Iterator[str]:
    port = free_port("127.0.0.1")
    (tmp / "key").write_text(ADMIN)
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n  - job_name: dspark\n    metrics_path: /metrics\n"
        f"    authorization: {{credentials_file: {tmp / 'key'}}}\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'db'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "prometheus.log", "w"))  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _query(url: str, expr: str) -> list:
    resp = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    assert resp.status_code == 200, f"{expr}: {resp.text}"
    return resp.json()["data"]["result"]


def _grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$model_name", ".+").replace("$arm", ".+")


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tiny_target, tiny_target_dir: Path,
                                                                   tmp_path: Path) -> None:
    ckpt = save_tiny_baseline(tiny_target, "dspark", tmp_path / "dspark")
    # the shipped shape: Serve pools under the application-level autoscaling policy (declarative deploy)
    # the hybrid as serve.yaml ships it (DSpark + the suffix sources: request and served text; the committed
    # corpus is SmolLM2's text, not the tiny model's), so the per-source panels have data too
    args = app_args(tiny_target_dir, drafter="hybrid",
                    drafter_kwargs={"path": str(ckpt), "sources": ["request", "served"]}, draft_gate=True,
                    pools="serve", verify_autoscaling={"min_replicas": 1, "max_replicas": 1},
                    draft_autoscaling={"min_replicas": 1, "max_replicas": 1},
                    admin_api_key_sha256=[key_digest(ADMIN)], cluster_name="dspark-prom")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with deployed(args, AUTOSCALING_POLICY, headers=admin) as client:
        assert client.get("/metrics", headers={"Authorization": ""}).status_code == 401
        target = str(client.base_url).removeprefix("http://").rstrip("/")
        with prometheus(target, tmp_path) as prom:
            def one(i: int) -> int:
                body = {"model": "tiny", "prompt": [5 + i % 7, 9, 11 + i % 5], "max_tokens": 24, "temperature": 0,
                        "ignore_eos": True, "stream": i % 2 == 0}
                return client.post("/v1/completions", json=body).status_code

            deadline = time.monotonic() + 25
            codes: list[int] = []
            with cf.ThreadPoolExecutor(4) as pool:
                while time.monotonic() < deadline:
                    codes += list(pool.map(one, range(8)))
            assert set(codes) == {200}
            assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
            text = ""
            for _ in range(60):  # the agents export every few seconds
                text = client.get("/metrics").text
                if all(name in text for name in VLLM_NAMES):
                    break
                time.sleep(1)
            missing = [n for n in VLLM_NAMES if n not in text]
            assert not missing, f"/metrics lacks {missing}"
            assert "ray_" not in text and "SessionName" not in text
            time.sleep(8)  # a few scrapes after the last increments
            queries = all_queries()
            empty = [(uid, title, expr) for uid, title, expr in queries if not _query(prom, _grafana_to_promql(expr))]
            assert not empty, f"{len(empty)} of {len(queries)} panel queries returned nothing: {empty}"
