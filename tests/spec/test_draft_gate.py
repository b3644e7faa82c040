"""The draft gate: skip drafting where it loses, probe with back-off, resume where it wins."""

from __future__ import annotations

import pytest

from dspark.spec.draft_gate import DraftGate
from dspark.spec.sps import SPSTable

# 100 ms per step up to 8 tokens, then ~linear: light load verifies for free, heavy load pays per token
SPS = SPSTable([1, 8, 16, 64], [100.0, 100.0, 150.0, 600.0])


def test_gain_ratio_is_hand_computed() -> None:
    gate = DraftGate()
    # B=1, no plain round measured yet: R_plain = the profile's T(1) = 100 ms.
    # A drafted round of 125 ms that accepted 2 → (1+2)/125 vs 1/100 → 2.4
    assert gate.record(1, 3, 2, 125.0, 100.0, SPS) == pytest.approx(3 / 125 / (1 / 100))
    # B=16: plain rounds measured at 120 ms; a drafted round of 300 ms that accepted 4
    gate.record_plain(16, 120.0)
    assert gate.plain_ms(16, SPS) == pytest.approx(120.0)
    assert gate.record(16, 16, 4, 300.0, 225.0, SPS) == pytest.approx((20 / 300) / (16 / 120))


def test_plain_rounds_are_measured_and_ignore_clock_noise() -> None:
    gate = DraftGate(smoothing=0.0)
    assert gate.plain_ms(1, SPS) == pytest.approx(100.0)  # nothing seen: the profile
    gate.record_plain(1, 50.0)
    assert gate.plain_ms(1, SPS) == pytest.approx(50.0)
    gate.record_plain(1, -3.0)
    assert gate.plain_ms(1, SPS) == pytest.approx(50.0)


def test_drafted_rounds_estimate_the_plain_round_so_an_open_gate_can_shut() -> None:
    # a machine 100x faster than the profile: with no plain round yet, the profile alone would say a
    # plain round costs 100 ms and any 2 ms drafted round wins; its verify forward (1 ms) says otherwise
    gate = DraftGate()
    assert gate.record(8, 0, 0, 2.0, 1.0, SPS) == pytest.approx((8 / 2.0) / (8 / 1.0))
    assert gate.plain_ms(8, SPS) == pytest.approx(1.0)
    assert gate.gains()[8] < 1.0
    assert not gate.should_draft(8)
    # verified tokens: the profile gives only the ratio T(16) / T(32) = 150 / 300
    gate.record(16, 16, 0, 2.0, 1.0, SPS)
    assert gate.plain_ms(16, SPS) == pytest.approx(0.5)


def test_one_lucky_probe_does_not_reopen_a_gate_many_probes_kept_shut() -> None:
    gate = DraftGate(probe_every=1, memory=0.9)
    gate.record_plain(1, 100.0)
    for i in range(20):  # drafted rounds: 1.5 tokens per 180 ms on average, against 1 token per 100 ms plain
        gate.record(1, 3, i % 2, 180.0, 100.0, SPS)
    assert gate.gains()[1] == pytest.approx(1.5 / 180 / (1 / 100), rel=0.03)  # recent rounds weigh more
    # a round that accepted 3 drafts in 200 ms (g = 2.0 on its own) moves the ratio of sums only so far
    assert gate.record(1, 3, 3, 200.0, 100.0, SPS) == pytest.approx(2.0)
    assert gate.gains()[1] < 1.0
    # with no memory the same round alone decides
    fresh = DraftGate(probe_every=1, memory=0.0)
    fresh.record_plain(1, 100.0)
    fresh.record(1, 3, 0, 180.0, 100.0, SPS)
    fresh.record(1, 3, 3, 200.0, 100.0, SPS)
    assert fresh.gains()[1] == pytest.approx(2.0)


def test_unknown_batch_size_drafts_and_winning_size_keeps_drafting() -> None:
    gate = DraftGate(plain_probe_every=8, max_plain_probe_every=16)
    assert gate.should_draft(4)
    gate.record(4, 3, 3, 105.0, 100.0, SPS)  # (4+3)/105 vs 4/100: wins
    # it keeps drafting, but for one plain step in every 8, which measures R_plain(4)
    assert [gate.should_draft(4) for _ in range(8)] == [True] * 7 + [False]
    gate.record_plain(4, 100.0)
    gate.record(4, 3, 3, 105.0, 100.0, SPS)  # drafting still wins: plain probes back off (to the cap, 16)
    assert [gate.should_draft(4) for _ in range(16)] == [True] * 15 + [False]
    gate.record_plain(4, 100.0)
    gate.record(4, 3, 3, 105.0, 100.0, SPS)
    assert [gate.should_draft(4) for _ in range(32)].count(False) == 2
    assert gate.num_skipped == 4


def test_a_plain_probe_shuts_a_gate_that_an_estimate_kept_open() -> None:
    # a profile flat from 16 to 32 tokens: the verify forward of 16 + 16 tokens (90 ms) is taken for a plain
    # round, and the drafted round (24 tokens in 90 ms) looks like a win; a measured plain round (50 ms) says not
    flat = SPSTable([1, 16, 32], [50.0, 90.0, 90.0])
    gate = DraftGate(probe_every=2, plain_probe_every=2, memory=0.0, smoothing=0.0)
    assert gate.record(16, 16, 8, 90.0, 90.0, flat) == pytest.approx(24 / 16)
    assert [gate.should_draft(16), gate.should_draft(16)] == [True, False]  # the plain probe
    gate.record_plain(16, 50.0)
    assert gate.record(16, 16, 8, 90.0, 90.0, flat) == pytest.approx((24 / 90) / (16 / 50))
    assert gate.gains()[16] < 1.0
    assert not gate.should_draft(16)


def test_losing_size_skips_then_probes_with_backoff() -> None:
    gate = DraftGate(probe_every=4, max_probe_every=16)
    assert gate.should_draft(16)
    gate.record(16, 0, 0, 200.0, 150.0, SPS)  # nothing accepted, 50 ms longer than a plain round: a pure loss
    decisions = [gate.should_draft(16) for _ in range(4)]
    assert decisions == [False, False, False, True]  # a probe every 4th step
    gate.record(16, 0, 0, 200.0, 150.0, SPS)  # the probe lost again: wait twice as long
    decisions = [gate.should_draft(16) for _ in range(8)]
    assert decisions == [False] * 7 + [True]
    gate.record(16, 0, 0, 200.0, 150.0, SPS)
    assert [gate.should_draft(16) for _ in range(16)].count(True) == 1  # capped at max_probe_every
    assert gate.gains()[16] < 1.0
    # other batch sizes are judged on their own; a size only measured plain has no gain yet
    gate.record_plain(2, 100.0)
    assert gate.should_draft(2) and 2 not in gate.gains()


def test_probe_that_wins_reopens_the_gate() -> None:
    gate = DraftGate(probe_every=2, memory=0.0)
    gate.record(8, 0, 0, 130.0, 100.0, SPS)
    assert not gate.should_draft(8)
    assert gate.should_draft(8)  # probe
    gate.record(8, 8, 8, 101.0, 150.0, SPS)  # drafts started landing: (8+8)/101 vs 8/100
    assert all(gate.should_draft(8) for _ in range(10))


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError):
        DraftGate(probe_every=0)
    with pytest.raises(ValueError):
        DraftGate(probe_every=8, max_probe_every=4)
    with pytest.raises(ValueError):
        DraftGate(memory=1.0)
    with pytest.raises(ValueError):
        DraftGate(smoothing=-0.1)


def test_overhead_outside_the_round_dilutes_the_draft_cost() -> None:
    gate = DraftGate(memory=0.0)
    # B=1, 1 accepted in a 160 ms round: (2/160) / (1/100) = 1.25 without overhead
    assert gate.record(1, 1, 1, 160.0, 100.0, SPS) == pytest.approx(1.25)
    for _ in range(200):
        gate.note_overhead(100.0)
    assert gate.overhead_ms == pytest.approx(100.0, rel=1e-6)
    assert gate.record(1, 1, 1, 160.0, 100.0, SPS) == pytest.approx((2 / 260) / (1 / 200), rel=1e-6)
    gate.note_overhead(-5.0)  # clock noise never counts as negative time
    assert gate.overhead_ms < 100.0


def test_one_slow_first_round_does_not_shut_the_gate_for_good() -> None:
    # an engine's first drafted round: 10x a warm one (lazy kernel set-up, cold caches)
    gate = DraftGate(probe_every=4)
    gate.record_plain(1, 100.0)
    gate.record(1, 3, 2, 1200.0, 100.0, SPS)
    assert gate.gains()[1] < 1.0  # alone it decides: shut
    assert [gate.should_draft(1) for _ in range(4)] == [False, False, False, True]
    # the probe is a warm round that wins: the cold one is an outlier against it and no longer counts
    gate.record(1, 3, 2, 120.0, 100.0, SPS)
    assert gate.gains()[1] == pytest.approx(3 / 120 / (1 / 100))
    assert all(gate.should_draft(1) for _ in range(10))
    # a plain round 20x slower moves R_plain by at most `outlier` x in one step
    gate.record_plain(1, 2000.0)
    assert gate.plain_ms(1, SPS) == pytest.approx(0.8 * 100.0 + 0.2 * 300.0)


def test_a_new_batch_size_starts_where_its_smaller_neighbour_is_shut() -> None:
    gate = DraftGate(probe_every=4)
    for _ in range(gate.inherit_min_rounds):
        gate.record(4, 3, 0, 200.0, 100.0, SPS)  # B=4 loses, round after round
    assert not gate.should_draft(4)
    # B=6 was never drafted at: it starts shut with B=4's back-off, then probes on its own
    assert [gate.should_draft(6) for _ in range(4)] == [False, False, False, True]
    assert 6 not in gate.gains()  # nothing measured at 6 yet
    gate.record(6, 6, 6, 110.0, 100.0, SPS)  # its own probe wins: (6+6)/110 vs 6/100
    assert gate.gains()[6] > 1.0 and all(gate.should_draft(6) for _ in range(5))
    # a smaller size than any measured, or one above an open size, drafts at once
    assert gate.should_draft(2)
    assert gate.should_draft(8)


def test_one_losing_round_at_a_small_size_does_not_shut_the_larger_ones() -> None:
    """A drain passes through sizes that never drafted: one unlucky round at batch 1 is no word on them."""
    gate = DraftGate(probe_every=4)
    gate.record(1, 7, 0, 120.0, 100.0, SPS)  # batch 1 drafted once and accepted nothing
    assert not gate.should_draft(1)
    assert all(gate.should_draft(b) for b in (2, 5, 12))  # larger sizes measure for themselves


def test_summary_shows_what_each_sizes_gain_rests_on() -> None:
    gate = DraftGate()
    gate.record_plain(1, 100.0)
    for ms in (170.0, 180.0, 190.0):  # 1 request + 1 accepted token a round
        gate.record(1, 3, 1, ms, 100.0, SPS)
    gate.record_plain(4, 40.0)  # a size with plain rounds only
    summary = gate.summary()
    assert summary[1]["num_rounds"] == 3 and summary[1]["round_ms_median"] == pytest.approx(180.0)
    assert summary[1]["tokens_mean"] == pytest.approx(2.0) and summary[1]["plain_ms"] == pytest.approx(100.0)
    assert summary[1]["gain"] == pytest.approx(gate.gains()[1])
    assert summary[4] == {"gain": None, "num_rounds": 0, "round_ms_median": None, "tokens_mean": None,
                          "plain_ms": pytest.approx(40.0), "plain_estimate_ms": None,
                          "probe_interval": gate.probe_every, "plain_interval": gate.plain_probe_every}


def test_rounds_that_accept_nothing_shut_the_gate_whatever_a_slow_plain_probe_read() -> None:
    gate = DraftGate()
    gate.record_plain(16, 33.0)  # one slow plain probe: 16 tokens in 33 ms
    for _ in range(4):  # drafted rounds of 27 ms (1 ms of it drafting) that verified drafts and accepted none
        gate.record(16, 4, 0, 27.0, 25.0, SPS, draft_ms=1.0)
    # against the probe they look 22 % faster; bounded by themselves (26 ms without drafting) they cannot win
    assert gate.gains()[16] == pytest.approx((16 / 27.0) / (16 / 26.0))
    assert gate.is_shut(16)
    # rounds that accept drafts are not held back by the bound: 16 + 8 tokens in 27 ms against 16 in 26
    opened = DraftGate()
    opened.record_plain(16, 26.0)
    opened.record(16, 12, 8, 27.0, 25.0, SPS, draft_ms=1.0)
    assert opened.gains()[16] == pytest.approx((24 / 27.0) / (16 / 26.0)) and not opened.is_shut(16)
