"""Serve config validation and the central scheduler's decisions (pure logic, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from dspark.actors.cluster_scheduler import ClusterScheduler, WorkerLoad
from dspark.config.serve import ABArm, ServeAppConfig
from dspark.spec.sps import SPSTable
from dspark.verify_service.step.capacity import CentralCapacity

ROOT = Path(__file__).resolve().parents[1]
SPS = SPSTable([1, 8, 16, 32, 64, 128], [70.0, 115.0, 118.0, 195.0, 304.0, 571.0])  # this CPU's profile shape


def test_the_shipped_serve_yaml_is_a_valid_decoupled_config():
    doc = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    ServeDeploySchema.model_validate(doc)  # what `serve run` reads, the application-level policy included
    app = doc["applications"][0]
    assert app["autoscaling_policy"]["policy_function"] == "dspark.autoscale.serve_policy:PoolAutoscaler"
    cfg = ServeAppConfig.model_validate(app["args"])
    assert cfg.mode == "decoupled" and cfg.scheduler == "central" and cfg.transport == "socket"
    assert cfg.pools == "serve" and cfg.verify_autoscaling and cfg.draft_autoscaling
    assert [a.name for a in cfg.ab_arms] == ["dspark", "mtp1"]
    mtp1 = cfg.arm_config(cfg.ab_arms[1])
    assert mtp1.drafter == "mtp1" and mtp1.num_draft_tokens == 1 and mtp1.scheduler_kwargs == {"k": 1}
    assert cfg.num_cpus_per_replica == pytest.approx(0.1)
    engine_cfg = cfg.worker_engine_config()
    # one micro-batch, the verify replica on both cores while its drafts are made (the two never compute at once)
    assert engine_cfg.drafter == "none" and engine_cfg.scheduler == "greedy" and engine_cfg.num_threads == 2
    assert cfg.micro_batches == 1 and mtp1.micro_batches == 1


@pytest.mark.parametrize(("mode", "drafter", "expected"), [("decoupled", "hybrid", 2), ("colocated", "hybrid", 1),
                                                           ("inline", "none", 1)])
def test_micro_batches_default_to_ping_pong_only_where_a_draft_pool_can_overlap(mode, drafter, expected):
    """An in-process drafter overlaps nothing: ping-pong would only halve each verify forward."""
    cfg = ServeAppConfig.model_validate({"mode": mode, "drafter": drafter})
    assert cfg.micro_batches == expected
    assert ServeAppConfig.model_validate({"mode": mode, "drafter": drafter, "num_micro_batches": 3}).micro_batches == 3
    # an A/B arm that changes the mode gets that mode's default, not the base's
    arm = cfg.arm_config(ABArm(name="other", weight=1.0, overrides={"mode": "colocated"}))
    assert arm.micro_batches == 1


@pytest.mark.parametrize(("args", "message"), [
    ({"scheduler": "central"}, "needs mode colocated or decoupled"),
    ({"mode": "decoupled", "pools": "actors", "num_verify_workers": 2, "num_draft_workers": 1}, "pairs workers 1:1"),
    ({"mode": "decoupled", "drafter": "none"}, "needs a drafter"),
    ({"mode": "sideways"}, "mode"),
    ({"transport": "carrier-pigeon"}, "transport"),
    ({"scheduler": "fastest"}, "unknown scheduler"),
    ({"verify_worker": {"num_cpu": 1}}, "num_cpu"),
    ({"cluster_name": "a b"}, "cluster_name"),
])
def test_bad_configs_fail_with_a_reason(args, message):
    with pytest.raises(ValidationError, match=message):
        ServeAppConfig.model_validate(args)


def load(worker: str, num_running: int, survival: list[list[float]], max_num_seqs: int = 16) -> WorkerLoad:
    return WorkerLoad(worker, num_running, 0, max_num_seqs, 10, 100.0, float(num_running * 2), survival,
                      SPS.to_dict())


def test_capacity_is_long_under_light_load_and_pruned_under_heavy_load():
    sched = ClusterScheduler()
    light = sched.report(load("v0", 1, [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]]))
    heavy = sched.report(load("v1", 32, [[0.5, 0.2, 0.1, 0.05, 0.0, 0.0, 0.0]] * 32, max_num_seqs=64))
    assert light.capacity >= 5  # one request: verifying is almost free, verify most of the block
    assert heavy.capacity < 32 * 2  # many requests: far fewer than 2 per request
    assert light.based_on_step == 10 and light.decision_ms < 50


def test_placement_prefers_the_emptier_worker_and_respects_kv_capacity():
    sched = ClusterScheduler()
    rows = [[0.8, 0.6, 0.4]]
    sched.report(load("v0", 12, rows * 12))
    sched.report(load("v1", 2, rows * 2))
    assert sched.place("r1", ["v0", "v1"]) == "v1"
    full = ClusterScheduler()
    full.report(load("a", 4, rows * 4, max_num_seqs=4))  # no KV slot left
    full.report(load("b", 10, rows * 10, max_num_seqs=16))
    assert full.place("r2", ["a", "b"]) == "b"
    assert full.snapshot()["placements"][-1]["worker_id"] == "b"


def test_placements_count_until_the_next_report():
    sched = ClusterScheduler()
    for w in ("a", "b"):
        sched.report(load(w, 0, []))
    placed = [sched.place(f"r{i}", ["a", "b"]) for i in range(6)]
    assert placed.count("a") == 3 and placed.count("b") == 3  # pending placements spread them
    sched.report(load("a", 3, [[0.5]] * 3))
    assert sched.pending["a"] == 0 and sched.pending["b"] == 3


def test_central_capacity_uses_fresh_k_and_falls_back_to_algorithm_1_when_stale():
    cap = CentralCapacity(max_age_steps=2)
    survival = [[0.9, 0.5, 0.1], [0.8, 0.2, 0.0]]
    first = cap.schedule(survival, SPS)  # no K yet: local Algorithm 1
    assert cap.num_fallback_steps == 1 and sum(first) >= 1
    cap.set_capacity(3)
    assert cap.schedule(survival, SPS) == [2, 1]  # top-3 by survival: 0.9, 0.8, 0.5
    cap.schedule(survival, SPS)
    cap.schedule(survival, SPS)  # K is now 3 steps old
    assert cap.num_central_steps == 2 and cap.num_fallback_steps == 2


def test_central_capacity_reports_the_last_table_that_held_drafts():
    # while the draft gate skips drafting the rows are empty; an empty table must not reach the scheduler
    # (it would answer K = 0 and the gate's next probe would be verified at length 0)
    cap = CentralCapacity()
    drafted = [[0.9, 0.5], [0.7]]
    cap.schedule(drafted, SPS)
    cap.schedule([[], []], SPS)
    cap.schedule([[], [], []], SPS)
    assert cap.last_survival == drafted
    assert ClusterScheduler().report(WorkerLoad("w", 2, 0, 8, 3, 70.0, 2.0, cap.last_survival,
                                                SPS.to_dict())).capacity > 0


def test_central_capacity_forgets_k_and_table_when_the_worker_re_pairs():
    # an unpaired worker reports no drafts, so the scheduler answers K = 0; once paired, that K must not
    # cut the new drafter's proposals to length 0 until the scheduler has seen a report made with it
    cap = CentralCapacity()
    cap.set_capacity(0)
    cap.schedule([[0.9, 0.5]], SPS)
    assert cap.schedule([[0.9, 0.5]], SPS) == [0]
    cap.reset()
    assert cap.capacity is None and cap.last_survival == []
    assert sum(cap.schedule([[0.9, 0.5]], SPS)) >= 1  # local Algorithm 1 until the next K
    assert cap.num_fallback_steps == 1
