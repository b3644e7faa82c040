"""The autoscaling policy (pure decision code) and its trace replay."""

from __future__ import annotations

from dspark.autoscale.policy import (
    SLA,
    AutoscalePolicy,
    DraftSignals,
    PolicyConfig,
    PoolLimits,
    VerifySignals,
    knee_of,
)
from dspark.autoscale.simulate import TRACES, SimConfig, simulate
from dspark.spec.sps import SPSTable

SPS = SPSTable([1, 8, 32, 64, 128, 256], [20.0, 22.0, 30.0, 45.0, 80.0, 160.0])


def _policy(**kw) -> AutoscalePolicy:  # noqa: ANN003
    return AutoscalePolicy(PolicyConfig(sla=SLA(ttft_p50_s=1.0, tpot_p50_s=0.05, max_queue_per_replica=4),
                                        verify=PoolLimits(1, 4), draft=PoolLimits(1, 4), knee_tokens=64,
                                        downscale_delay_s=30.0, **kw))


def _verify(n: int, tokens: float = 10, queue: float = 0, ttft: float = 0.05, tpot: float = 0.01,
            age: float = 0.0) -> VerifySignals:
    return VerifySignals(n, tokens, queue, ttft, tpot, age)


def test_knee_is_where_throughput_stops_paying_for_more_tokens() -> None:
    # tokens/ms: 0.05, 0.36, 1.07, 1.42, 1.6, 1.6 -> 80 % of the best (1.28) first reached at 64
    assert knee_of(SPS) == 64


def test_verify_scales_up_at_once_by_what_the_queue_needs() -> None:
    d = _policy().decide_verify(0.0, _verify(1, queue=10))
    assert d.is_change and d.target == 3 and "queue" in d.reasons[0]  # 10 / 4 per replica -> 3


def test_starting_replicas_count_and_are_not_asked_for_twice() -> None:
    p = _policy()
    assert not p.decide_verify(0.0, _verify(1, queue=6), pending=1).is_change  # 2 asked, 2 needed
    assert p.decide_verify(5.0, _verify(1, queue=14), pending=1).target == 4  # the queue grew past that


def test_scale_down_waits_for_the_delay_and_only_if_fewer_replicas_hold_the_load() -> None:
    p = _policy()
    # 2 replicas at 20 tokens/step: 1 replica would run 40 tokens/step = 0.62 of the 64 knee -> may go
    assert not p.decide_verify(0.0, _verify(2, tokens=20)).is_change  # low: the clock starts
    assert not p.decide_verify(20.0, _verify(2, tokens=20)).is_change  # still inside the delay
    d = p.decide_verify(31.0, _verify(2, tokens=20))
    assert d.target == 1 and d.reasons[0].startswith("down")
    # at 30 tokens/step, 1 replica would run 60 = 0.94 of the knee, above the 0.7 margin: stays
    q = _policy()
    for t in (0.0, 40.0, 80.0):
        assert not q.decide_verify(t, _verify(2, tokens=30)).is_change


def test_a_burst_resets_the_downscale_clock() -> None:
    p = _policy()
    p.decide_verify(0.0, _verify(2, tokens=10))
    p.decide_verify(20.0, _verify(2, queue=12))  # burst: scales up, clock reset
    assert not p.decide_verify(35.0, _verify(3, tokens=10)).is_change  # low again only since 35 s


def test_stale_metrics_hold_both_pools() -> None:
    p = _policy()
    v = p.decide_verify(0.0, _verify(2, tokens=1, age=45.0))
    d = p.decide_draft(0.0, DraftSignals(3, utilisation=0.0, draft_wait_ms=0.0, age_s=45.0))
    assert v.is_hold and d.is_hold and not v.is_change and not d.is_change


def test_the_draft_pool_scales_on_its_own_signal() -> None:
    p = _policy()
    # verify is idle, but drafting is saturated: only the draft pool grows
    assert not p.decide_verify(0.0, _verify(1, tokens=5)).is_change
    d = p.decide_draft(0.0, DraftSignals(1, utilisation=0.99, draft_wait_ms=25.0))
    assert d.target == 3 and "draft wait" in d.reasons[0]


def test_max_replicas_caps_and_says_so() -> None:
    d = _policy().decide_verify(0.0, _verify(4, queue=100))
    assert not d.is_change and "max_replicas" in d.reasons[0]


def test_trace_replay_scales_both_pools_up_and_down_and_loses_nothing() -> None:
    cfg = PolicyConfig(sla=SLA(ttft_p50_s=1.0, tpot_p50_s=0.05, max_queue_per_replica=8), knee_tokens=knee_of(SPS))
    res = simulate(TRACES["falling"], SPS, cfg, SimConfig(stale_windows=[(300, 330)]))
    targets = [(d["pool"], d["target"] - d["current"]) for d in res["decisions"]]
    assert ("verify", 1) in [(p, min(k, 1)) for p, k in targets] and ("verify", -1) in targets
    assert any(p == "draft" and k > 0 for p, k in targets) and any(p == "draft" and k < 0 for p, k in targets)
    assert res["num_holds"] > 0  # the stale window held
    assert res["num_lost"] == 0 and res["num_waiting_at_end"] == 0 and res["num_completed"] > 1000
    assert res["timeline"][-1]["verify_replicas"] == 1  # back to the floor when the load is gone
