"""`dspark bench chaos` on a real local cluster (tiny model, decoupled 2 verify + 2 draft workers, gloo,
central scheduler), with the pools as named actors and as Serve deployments: kill -9 a draft worker, a
verify worker, the scheduler, then a draft and a verify worker together, each under load. No request
fails, every greedy output equals the fault-free run's, the cluster is whole again after each fault, and
nothing is held afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.bench.chaos import SCENARIOS, run_chaos
from tests.test_cluster_serving import app_args


@pytest.mark.parametrize("pools", ["actors", "serve"])
def test_chaos_loses_nothing_changes_nothing_and_recovers(tiny_target_dir: Path, pools: str) -> None:
    args = app_args(tiny_target_dir, cluster_name=f"dspark-chaos-{pools}", pools=pools)
    prompts = [f"the {w} and the cat" for w in ("dog", "sun", "sea", "hat", "map", "owl")]
    res = run_chaos(args, prompts, max_tokens=160, kill_after_s=0.5, recover_timeout_s=120)
    assert set(res["scenarios"]) == set(SCENARIOS)
    for name, sc in res["scenarios"].items():
        assert sc["num_failed"] == 0, (name, sc["errors"])
        assert sc["num_outputs_differing"] == 0, name
        assert sc["recovered_s_after_kill"] is not None, name
        assert sc["held_after"] == {"kv_slots": 0, "waiting": 0, "draft_contexts": 0}, (name, sc["held_after"])
    assert res["summary"]["requests_lost"] == 0 and res["summary"]["all_recovered"]
