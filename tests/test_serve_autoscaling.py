"""Autoscaling of the Serve pools on a real local Ray cluster (tiny model, decoupled, `pools: serve`), deployed
the declarative way with the application-level policy (`dspark.autoscale.serve_policy:PoolAutoscaler`): under
a ramp of load the verify pool goes 1 -> 2 and the draft pool with it, when the load falls it goes back to 1;
every request across the scale events completes, and the decisions are in the controller log and /metrics."""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ray
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from dspark.actors.transport import free_port
from tests.test_cluster_serving import app_args
from tests.test_serve_http import _wait_healthy

NUM_NEW = 48


def _running(deployment: str) -> int:
    try:
        states = serve.status().applications["dspark"].deployments[deployment].replica_states
    except KeyError:
        return 0
    return int(sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING"))


def _all_healthy() -> bool:
    app = serve.status().applications.get("dspark")
    return app is not None and all(str(getattr(d.status, "value", d.status)) == "HEALTHY"
                                   for d in app.deployments.values())


class _Load:
    """`n` closed-loop clients; every response recorded."""

    def __init__(self, client: httpx.Client, n: int) -> None:
        self.client, self.results, self.stop = client, [], threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        while not self.stop.is_set():
            body = {"model": "tiny", "prompt": [5 + i, 9, 11], "max_tokens": NUM_NEW, "temperature": 0,
                    "ignore_eos": True, "stream": i % 2 == 0}
            try:
                resp = self.client.post("/v1/completions", json=body)
                ok = resp.status_code == 200 and "error" not in resp.text.replace('"error_', "")
                self.results.append(ok)
            except httpx.HTTPError:
                self.results.append(False)

    def finish(self) -> list[bool]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        return self.results


def _wait(cond, timeout_s: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    return False


# a tiny model on 2 shared cores: tokens per step is the verify signal that moves (the draft pool follows the
# verify pool, 1:1 pairing); the SLA (args.sla: admission and the policy read the one value) is out of reach
# so neither it nor admission's pressure interferes
AUTOSCALING_POLICY = {"policy_function": "dspark.autoscale.serve_policy:PoolAutoscaler",
                      "policy_kwargs": {"knee_tokens": 4, "downscale_delay_s": 4, "max_queue_per_replica": 1e3,
                                        "max_draft_wait_ms": 1e4}}
SLA_OUT_OF_REACH = {"ttft_s": 1e3, "tpot_s": 1e3}


# the tiny model's n-gram drafts keep a draft replica ~0.1-0.5% busy under 8 clients, 0 when idle
DRAFT_BUSY_HIGH = 1e-4


@contextlib.contextmanager
def deployed(args: dict, policy: dict, headers: dict | None = None) -> Iterator[httpx.Client]:
    """The app deployed the declarative way (`serve run <yaml>` does this), with an application-level policy."""
    port = free_port("127.0.0.1")
    for var in ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"):
        os.environ.setdefault(var, "60")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        client = serve_start(http_options={"host": "127.0.0.1", "port": port})
        client.deploy_apps(ServeDeploySchema.model_validate({"applications": [{
            "name": "dspark", "route_prefix": "/", "import_path": "dspark.cluster.app:build_app", "args": args,
            "autoscaling_policy": policy}]}))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, headers=headers) as http:
            _wait_healthy(http, 180)
            assert _wait(_all_healthy, 180), serve.status()  # the pools too, not only the ingress
            yield http
    finally:
        serve.shutdown()
        ray.shutdown()


def test_pools_scale_up_and_down_with_the_load_and_lose_nothing(tiny_target_dir: Path) -> None:
    args = app_args(tiny_target_dir, pools="serve", cluster_name="dspark-autoscale", max_num_seqs=8,
                    sla=SLA_OUT_OF_REACH,
                    verify_autoscaling={"min_replicas": 1, "max_replicas": 2},
                    draft_autoscaling={"min_replicas": 1, "max_replicas": 2})
    with deployed(args, AUTOSCALING_POLICY) as http:
        assert _wait(lambda: _running("default-verify") == 1 and _running("default-draft") == 1, 120)
        heavy = _Load(http, 8)
        scaled_up = _wait(lambda: _running("default-verify") == 2 and _running("default-draft") == 2, 120)
        time.sleep(3)  # load on both replicas for a while
        results = heavy.finish()
        assert scaled_up, "the verify and draft pools did not reach 2 replicas under load"
        light = _Load(http, 1)  # a trickle while the pools shrink: the replica that goes drains first
        scaled_down = _wait(lambda: _running("default-verify") == 1 and _running("default-draft") == 1, 120)
        time.sleep(2)
        results += light.finish()
        assert scaled_down, "the pools did not go back to 1 replica"
        assert results and all(results), f"{results.count(False)} of {len(results)} requests failed"
        text = ""
        for _ in range(30):
            text = http.get("/metrics").text
            if 'direction="up"' in text and 'direction="down"' in text:
                break
            time.sleep(1)
        assert "dspark_autoscale_decisions_total" in text and 'direction="up"' in text
        assert 'direction="down"' in text
        logs = "".join(Path(p).read_text(errors="replace") for p in
                       glob.glob("/tmp/ray/session_latest/logs/serve/controller_*.log"))
        assert "dspark autoscale default-verify: 1 -> 2" in logs and "dspark autoscale default-verify: 2 -> 1" in logs


def _partners(http: httpx.Client) -> dict[str, str | None]:
    verify = http.get("/v1/dspark/stats").json().get("scheduler", {}).get("replicas", {}).get("verify", {})
    return {v: info.get("draft_partner") for v, info in verify.items()}


def test_the_draft_pool_scales_on_its_own_signal_while_the_verify_pool_holds(tiny_target_dir: Path) -> None:
    """Two verify replicas share one draft replica (max_verify_per_draft 2); the draft replica's utilisation
    alone scales the draft pool 1 -> 2 (a verify replica moves to the new one) and back, with the verify
    pool fixed at 2; nothing fails across the moves."""
    args = app_args(tiny_target_dir, pools="serve", cluster_name="dspark-draftscale", max_num_seqs=8,
                    sla=SLA_OUT_OF_REACH,
                    num_verify_workers=2, num_draft_workers=1, max_verify_per_draft=2,
                    verify_autoscaling={"min_replicas": 2, "max_replicas": 2},
                    draft_autoscaling={"min_replicas": 1, "max_replicas": 2})
    policy = {"policy_function": AUTOSCALING_POLICY["policy_function"],
              "policy_kwargs": {**AUTOSCALING_POLICY["policy_kwargs"], "knee_tokens": 1e6, "max_verify_per_draft": 2,
                                "draft_utilisation_high": DRAFT_BUSY_HIGH}}
    with deployed(args, policy) as http:
        assert _wait(lambda: _running("default-verify") == 2 and _running("default-draft") == 1, 120)
        assert _wait(lambda: len(set(_partners(http).values()) - {None}) == 1 and None not in _partners(http).values(),
                     60), _partners(http)  # both verify replicas draft on the one draft replica
        heavy = _Load(http, 8)
        scaled_up = _wait(lambda: _running("default-draft") == 2, 120)
        moved = _wait(lambda: len(set(_partners(http).values()) - {None}) == 2, 60)  # one moved to the new one
        time.sleep(2)
        results = heavy.finish()
        assert scaled_up, "the draft pool did not scale up on its utilisation"
        assert moved, f"no verify replica moved to the new draft replica: {_partners(http)}"
        assert _running("default-verify") == 2
        scaled_down = _wait(lambda: _running("default-draft") == 1, 120)
        light = _Load(http, 1)  # requests across the partner loss: the orphaned verify replica re-pairs
        repaired = _wait(lambda: len(set(_partners(http).values()) - {None}) == 1, 60)
        time.sleep(3)
        results += light.finish()
        assert scaled_down, "the draft pool did not go back to 1 replica"
        assert repaired, _partners(http)
        assert results and all(results), f"{results.count(False)} of {len(results)} requests failed"
        logs = "".join(Path(p).read_text(errors="replace") for p in
                       glob.glob("/tmp/ray/session_latest/logs/serve/controller_*.log"))
        assert "dspark autoscale default-draft: 1 -> 2" in logs and "dspark autoscale default-draft: 2 -> 1" in logs
        assert "dspark autoscale default-verify: 2 -> 3" not in logs
