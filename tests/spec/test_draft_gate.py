"""The draft gate: skip drafting where it loses, probe with back-off, resume where it wins."""

from __future__ import annotations

import pytest

from dspark.spec.draft_gate import DraftGate
from dspark.spec.sps import SPSTable

# 100 ms per step up to 8 tokens, then ~linear: light load verifies for free, heavy load pays per token
SPS = SPSTable([1, 8, 16, 64], [100.0, 100.0, 150.0, 600.0])


def test_gain_ratio_is_hand_computed() -> None:
    gate = DraftGate()
    # B=1: verified 3, accepted 2, draft 25 ms → (1+2)/(100+25) vs 1/100 → 2.4
    assert gate.record(1, 3, 2, 25.0, SPS) == pytest.approx(3 / 125 / (1 / 100))
    # B=16: 16 verified, 4 accepted, 40 ms draft → (20/(T(32)+40)) / (16/150)
    t32 = 150.0 + (600.0 - 150.0) * (32 - 16) / (64 - 16)
    assert gate.record(16, 16, 4, 40.0, SPS) == pytest.approx((20 / (t32 + 40)) / (16 / 150))


def test_unknown_batch_size_drafts_and_winning_size_keeps_drafting() -> None:
    gate = DraftGate()
    assert gate.should_draft(4)
    gate.record(4, 4, 3, 5.0, SPS)  # (4+3)/105 vs 4/100: wins
    assert all(gate.should_draft(4) for _ in range(20))
    assert gate.num_skipped == 0


def test_losing_size_skips_then_probes_with_backoff() -> None:
    gate = DraftGate(probe_every=4, max_probe_every=16)
    assert gate.should_draft(16)
    gate.record(16, 0, 0, 50.0, SPS)  # nothing verified, 50 ms spent drafting: a pure loss
    decisions = [gate.should_draft(16) for _ in range(4)]
    assert decisions == [False, False, False, True]  # a probe every 4th step
    gate.record(16, 0, 0, 50.0, SPS)  # the probe lost again: wait twice as long
    decisions = [gate.should_draft(16) for _ in range(8)]
    assert decisions == [False] * 7 + [True]
    gate.record(16, 0, 0, 50.0, SPS)
    assert [gate.should_draft(16) for _ in range(16)].count(True) == 1  # capped at max_probe_every
    assert gate.gains()[16] < 1.0
    # other batch sizes are judged on their own
    assert gate.should_draft(2)


def test_probe_that_wins_reopens_the_gate() -> None:
    gate = DraftGate(probe_every=2, smoothing=0.0)
    gate.record(8, 0, 0, 30.0, SPS)
    assert not gate.should_draft(8)
    assert gate.should_draft(8)  # probe
    gate.record(8, 8, 8, 1.0, SPS)  # drafts started landing: (8+8)/101 vs 8/100
    assert all(gate.should_draft(8) for _ in range(10))


def test_rejects_bad_options() -> None:
    with pytest.raises(ValueError):
        DraftGate(probe_every=0)
    with pytest.raises(ValueError):
        DraftGate(probe_every=8, max_probe_every=4)
    with pytest.raises(ValueError):
        DraftGate(smoothing=1.0)


def test_overhead_outside_the_round_dilutes_the_draft_cost() -> None:
    gate = DraftGate(smoothing=0.0)
    # B=1, 1 accepted of 1 verified, 60 ms draft: (2/(100+60)) / (1/100) = 1.25 without overhead
    assert gate.record(1, 1, 1, 60.0, SPS) == pytest.approx(1.25)
    for _ in range(200):
        gate.note_overhead(100.0)
    assert gate.overhead_ms == pytest.approx(100.0, rel=1e-6)
    assert gate.record(1, 1, 1, 60.0, SPS) == pytest.approx((2 / 260) / (1 / 200), rel=1e-6)
    gate.note_overhead(-5.0)  # clock noise never counts as negative time
    assert gate.overhead_ms < 100.0
