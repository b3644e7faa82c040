"""Admission by predicted latency (pure code): the limit is the largest load whose predicted TTFT and TPOT are
within the SLA, grows with the verify replicas, never passes the static bound, refuses with the predicted
wait; its pressure drives the autoscaling policy, which takes the SLA from the pools' reports (one place)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from dspark.autoscale.serve_policy import PoolAutoscaler
from dspark.cluster.ingress.admission import Admission, SLATarget
from dspark.cluster.ingress.latency_model import LatencyModel, _Bins


def _measured(adm: Admission, tpot_by_batch: dict[int, float], ttft_s: float = 0.1) -> Admission:
    for b, tpot in tpot_by_batch.items():
        adm.model.tpot.add(b, tpot)
        adm.model.ttft.add(b, ttft_s)
    adm.model.version += 1
    return adm


def test_bins_read_monotone_and_extrapolate_with_no_batching_gain() -> None:
    bins = _Bins()
    bins.add(1, 0.02)
    bins.add(4, 0.05)
    bins.add(2, 0.06)  # noise: higher than at 4
    assert bins.at(1) == 0.02 and bins.at(2) == 0.06 and bins.at(4) == 0.06  # never falls with load
    assert bins.at(3) == pytest.approx(0.06)
    assert bins.at(8) == pytest.approx(0.06 * 8 / 4)  # past the highest measured: the upper bound
    assert _Bins().at(3) is None


def test_tokens_per_running_request_become_tpot_by_batch_size() -> None:
    model = LatencyModel(max_batch=8, window_s=0.05)
    for _ in range(2):
        model.first_token(0.1, 2)
    t_end = time.monotonic() + 0.12
    while time.monotonic() < t_end:  # 2 decoding requests, ~1 token each per 5 ms
        model.tokens(1)
        model.tokens(1)
        time.sleep(0.005)
    model.tokens(1)  # closes the window
    tpot = model.tpot.at(2)
    assert tpot is not None and 0.003 < tpot < 0.02, model.tpot.means
    assert model.measured_batch() == 2


def test_limit_is_the_largest_load_within_the_sla_and_the_static_bound() -> None:
    sla = SLATarget(ttft_s=2.0, tpot_s=0.25, headroom=1.0)
    adm = _measured(Admission(capacity=32, max_queued_requests=32, sla=sla, max_batch=32),
                    {1: 0.05, 4: 0.10, 8: 0.20, 12: 0.30})
    assert adm.sla_limit() == 10  # 0.20 at 8, 0.30 at 12: 0.25 at 10
    for _ in range(10):
        assert adm.try_enter()
    assert not adm.try_enter() and adm.num_shed == 1
    assert adm.retry_after_s() >= 1
    static = Admission(capacity=32, max_queued_requests=32)
    assert static.mode == "static" and static.current_limit() == 64
    # fast hardware: the SLA would allow more than memory does; the static bound holds
    fast = _measured(Admission(capacity=4, max_queued_requests=2, sla=sla, max_batch=4), {1: 0.001, 4: 0.002})
    assert fast.sla_limit() <= fast.hard_limit == 6


def test_queueing_past_the_batch_counts_against_the_ttft() -> None:
    sla = SLATarget(ttft_s=1.0, tpot_s=10.0, headroom=1.0)
    adm = _measured(Admission(capacity=2, max_queued_requests=20, sla=sla, max_batch=2), {1: 0.01, 2: 0.01},
                    ttft_s=0.1)
    adm.model._run_s = 0.5  # a request runs 0.5 s: past 2 in flight each one more waits 0.25 s
    assert adm.sla_limit() == 5  # 0.1 + 3 * 0.25 = 0.85 <= 1.0; a 6th would start at 1.1 s


def test_the_limit_says_what_bounds_it_and_a_refusal_says_why() -> None:
    sla = SLATarget(ttft_s=2.0, tpot_s=0.25, headroom=1.0)
    fresh = Admission(capacity=4, max_queued_requests=4, sla=sla, max_batch=4)
    assert fresh.sla_limit() == 4 and fresh.limit_reason == "unmeasured"  # one batch, nothing queued
    by_tpot = _measured(Admission(capacity=32, max_queued_requests=32, sla=sla, max_batch=32),
                        {1: 0.05, 8: 0.20, 12: 0.30})
    assert by_tpot.sla_limit() == 10 and by_tpot.limit_reason == "tpot"
    for _ in range(10):
        by_tpot.try_enter()
    assert by_tpot.refusal_reason() == "tpot" and by_tpot.refusal_reason("static") == "full"
    by_ttft = _measured(Admission(capacity=2, max_queued_requests=20, sla=SLATarget(1.0, 10.0, 1.0), max_batch=2),
                        {1: 0.01, 2: 0.01})
    by_ttft.model._run_s = 0.5
    assert by_ttft.sla_limit() == 5 and by_ttft.limit_reason == "ttft"
    loose = _measured(Admission(capacity=2, max_queued_requests=1, sla=sla, max_batch=2), {1: 0.01, 2: 0.01})
    loose.model._run_s = 0.1
    assert loose.sla_limit() == 3 and loose.limit_reason == "bound"
    for _ in range(3):
        loose.try_enter()
    assert loose.refusal_reason() == "full"
    assert by_tpot.num_verify_replicas == 1
    by_tpot.set_replicas(2)
    assert by_tpot.num_verify_replicas == 2


def test_the_limit_grows_with_the_verify_replicas() -> None:
    sla = SLATarget(ttft_s=2.0, tpot_s=0.25, headroom=1.0)
    adm = _measured(Admission(capacity=32, max_queued_requests=64, sla=sla, max_batch=32), {1: 0.05, 8: 0.25})
    one = adm.sla_limit()
    adm.set_replicas(2)
    assert adm.sla_limit() == 2 * one


def test_before_any_measurement_one_batch_is_admitted_and_nothing_queued() -> None:
    adm = Admission(capacity=32, max_queued_requests=32, sla=SLATarget(2.0, 0.25), max_batch=32)
    assert adm.sla_limit() == 32


def test_pressure_is_demand_over_what_is_served_within_the_sla() -> None:
    sla = SLATarget(ttft_s=2.0, tpot_s=0.25, headroom=1.0)
    adm = _measured(Admission(capacity=32, max_queued_requests=32, sla=sla, max_batch=32), {1: 0.05, 4: 0.25})
    for _ in range(4):
        adm.try_enter()
    assert adm.pressure() == pytest.approx(1.0)
    for _ in range(12):  # three times as many asked as were admitted
        adm.try_enter()
    assert adm.pressure() == pytest.approx(4.0)


@dataclass
class _Ctx:
    """What Serve hands an application-level policy per deployment (the fields the policy reads)."""

    current_num_replicas: int
    target_num_replicas: int
    aggregated_metrics: dict
    raw_metrics: dict = field(default_factory=dict)
    capacity_adjusted_min_replicas: int = 1
    capacity_adjusted_max_replicas: int = 4


@dataclass(frozen=True)
class _Dep:
    name: str


def test_the_policy_scales_the_pool_on_admission_pressure_with_the_sla_the_pools_report() -> None:
    policy = PoolAutoscaler(knee_tokens=1000, max_queue_per_replica=100)
    verify = _Ctx(1, 1, {"tokens_per_step": {"r": 1.0}, "ttft_p50_s": {"r": 0.5}, "tpot_p50_s": {"r": 0.1},
                         "sla_ttft_s": {"r": 2.0}, "sla_tpot_s": {"r": 0.25}})
    calm = _Ctx(1, 1, {"admission_pressure:a": {"i": 0.6}})
    decisions, _ = policy({_Dep("a-verify"): verify, _Dep("SpecDecodeServer"): calm})
    assert decisions[_Dep("a-verify")] == 1 and policy.policies["a"].config.sla.tpot_p50_s == 0.25
    shedding = _Ctx(1, 1, {"admission_pressure:a": {"i": 1.8}})
    decisions, state = policy({_Dep("a-verify"): verify, _Dep("SpecDecodeServer"): shedding})
    assert decisions[_Dep("a-verify")] == 2
    assert "admission demand vs SLA capacity" in state[_Dep("a-verify")]["last_decision"]["reasons"][0]
    with pytest.raises(ValueError, match="args"):
        PoolAutoscaler(ttft_p50_s=2.0)


def test_one_outlying_reading_moves_a_bin_by_a_bounded_step_and_a_real_change_still_gets_there() -> None:
    """A TTFT that waited for reasons the load does not say (placed behind a full batch, a replica warming
    up) moves its bin by at most alpha x (max_jump - 1) of itself; a load that really got slower is reached
    within a few readings."""
    bins = _Bins()
    bins.add(2, 0.05)
    bins.add(2, 2.0)  # one request queued behind a batch
    assert bins.at(2) == pytest.approx(0.05 + 0.3 * (0.15 - 0.05))
    for _ in range(12):
        bins.add(2, 2.0)
    assert bins.at(2) > 1.5


def test_a_ttft_is_binned_by_the_replicas_there_were_when_its_request_was_sent() -> None:
    model = LatencyModel(max_batch=2)
    model.num_replicas = 2.0  # a second replica was counted while the request was on its way
    model.first_token(0.5, 3, num_replicas_at_start=1.0)
    assert set(model.ttft.means) == {3}  # 3 in flight on one replica, not ceil(3 / 2)
    model.first_token(0.05, 3)
    assert model.ttft.means[2] == 0.05
