"""The pools' membership and pairing (pure logic): heartbeats, expiry, 1:1 assignment, freed partners."""

from __future__ import annotations

import pytest

from dspark.actors.registry import Registry


def test_replicas_live_while_they_beat_and_expire_after_the_ttl() -> None:
    reg = Registry(ttl_s=10.0)
    reg.heartbeat("verify", "v1", {"pid": 1}, now_s=0.0)
    reg.heartbeat("draft", "d1", now_s=0.0)
    assert reg.live("verify", now_s=5.0) == ["v1"] and reg.live("draft", now_s=5.0) == ["d1"]
    reg.heartbeat("verify", "v1", now_s=9.0)
    assert reg.live("verify", now_s=15.0) == ["v1"] and reg.live("draft", now_s=15.0) == []
    assert reg.snapshot(now_s=15.0)["verify"]["v1"]["pid"] == 1
    with pytest.raises(ValueError, match="pool"):
        reg.heartbeat("gpu", "x")


def test_each_verify_replica_gets_its_own_draft_replica_and_a_dead_ones_partner_is_freed() -> None:
    reg = Registry(ttl_s=15.0, partner_stale_s=5.0)
    for rid in ("d1", "d2"):
        reg.heartbeat("draft", rid, now_s=0.0)
    for rid in ("v1", "v2", "v3"):
        reg.heartbeat("verify", rid, now_s=0.0)
    a, b = reg.assign_draft("v1", now_s=1.0), reg.assign_draft("v2", now_s=1.0)
    assert {a, b} == {"d1", "d2"}
    assert reg.assign_draft("v3", now_s=1.0) is None  # every draft replica is taken: v3 decodes target-only
    assert reg.num_unpaired(now_s=1.0) == 1
    reg.heartbeat("draft", "d1", now_s=6.0)
    reg.heartbeat("draft", "d2", now_s=6.0)
    reg.heartbeat("verify", "v2", now_s=6.0)
    reg.heartbeat("verify", "v3", now_s=6.0)  # v1 stopped beating: dead
    assert reg.assign_draft("v3", now_s=7.0) == a  # v1's partner is free again before v1 expires
    assert reg.assign_draft("v3", exclude=(a,), now_s=7.0) is None  # a partner that just failed is skipped


def test_a_replica_that_leaves_frees_its_partner_at_once() -> None:
    reg = Registry()
    reg.heartbeat("draft", "d1", now_s=0.0)
    reg.heartbeat("verify", "v1", now_s=0.0)
    reg.heartbeat("verify", "v2", now_s=0.0)
    assert reg.assign_draft("v1", now_s=0.0) == "d1"
    reg.leave("v1")
    assert reg.assign_draft("v2", now_s=0.0) == "d1"


def test_a_new_draft_replica_takes_one_verify_partner_from_the_loaded_one() -> None:
    reg = Registry()
    reg.heartbeat("draft", "d1", now_s=0.0)
    for rid in ("v1", "v2", "v3"):
        reg.heartbeat("verify", rid, now_s=0.0)
        assert reg.assign_draft(rid, max_partners=3, now_s=0.0) == "d1"  # M:N: one draft replica for three
    assert all(reg.rebalance(v, max_partners=3, now_s=0.0) is None for v in ("v1", "v2", "v3"))  # nowhere to go
    reg.heartbeat("draft", "d2", now_s=1.0)  # the draft pool scaled up
    assert reg.rebalance("v1", max_partners=3, now_s=1.0) is None  # one mover per pass: the last by id
    assert reg.rebalance("v3", max_partners=3, now_s=1.0) == "d2"
    # d1 has 2, d2 has 1: moving another would not even it out
    assert all(reg.rebalance(v, max_partners=3, now_s=1.0) is None for v in ("v1", "v2", "v3"))
    assert sorted(reg.partner.values()) == ["d1", "d1", "d2"]


def test_a_draining_draft_replicas_partners_move_where_there_is_room() -> None:
    reg = Registry()
    for rid in ("d1", "d2"):
        reg.heartbeat("draft", rid, now_s=0.0)
    reg.heartbeat("verify", "v1", now_s=0.0)
    reg.heartbeat("verify", "v2", now_s=0.0)
    assert {reg.assign_draft("v1", now_s=0.0), reg.assign_draft("v2", now_s=0.0)} == {"d1", "d2"}
    reg.heartbeat("draft", "d2", is_draining=True, now_s=1.0)
    leaving = next(v for v, d in reg.partner.items() if d == "d2")
    assert reg.rebalance(leaving, max_partners=1, now_s=1.0) is None  # 1 per draft replica: no room on d1
    assert reg.rebalance(leaving, max_partners=2, now_s=1.0) == "d1"


def test_a_verify_replica_whose_partner_is_gone_moves_to_a_live_one() -> None:
    # a draft replica scaled away: its idle verify partner's link has not failed yet (it notices at its next
    # send), so the scheduler tells it to move at its next rebalance
    reg = Registry(ttl_s=10.0, started_s=0.0)
    for rid in ("d1", "d2"):
        reg.heartbeat("draft", rid, now_s=0.0)
    reg.heartbeat("verify", "v1", now_s=0.0)
    reg.heartbeat("verify", "v2", now_s=0.0)
    assert reg.assign_draft("v1", max_partners=2, now_s=0.0) == "d1"
    assert reg.assign_draft("v2", max_partners=2, now_s=0.0) == "d2"
    for pool, rid in (("draft", "d1"), ("draft", "d2"), ("verify", "v1"), ("verify", "v2")):
        reg.heartbeat(pool, rid, now_s=10.0)
    assert reg.rebalance("v2", max_partners=2, now_s=11.0) is None  # d2 is not gone yet, nothing to even out
    reg.leave("d2")
    assert reg.rebalance("v1", max_partners=2, now_s=11.0) is None  # v1's partner lives
    assert reg.rebalance("v2", max_partners=2, now_s=11.0) == "d1"
    assert reg.partner == {"v1": "d1", "v2": "d1"}
    # just after a scheduler restart, a partner it has not heard from yet is not taken for gone
    fresh = Registry(ttl_s=10.0, started_s=100.0)
    fresh.heartbeat("draft", "d1", now_s=101.0)
    fresh.heartbeat("verify", "v2", {"draft_partner": "d2"}, now_s=101.0)
    assert fresh.rebalance("v2", max_partners=2, now_s=102.0) is None
    assert fresh.rebalance("v2", max_partners=2, now_s=111.0) == "d1"
