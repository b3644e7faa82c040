"""prefix_survival (tensor and ragged rows) and AcceptanceTracker."""

from __future__ import annotations

import pytest
import torch

from dspark.spec.survival import AcceptanceTracker, prefix_survival, prefix_survival_rows


def test_prefix_survival_is_the_cumulative_product() -> None:
    confidences = torch.tensor([[0.9, 0.5, 0.8], [1.0, 0.0, 0.7]])
    expected = torch.tensor([[0.9, 0.45, 0.36], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(prefix_survival(confidences), expected)


def test_prefix_survival_zeroes_positions_beyond_the_draft_length() -> None:
    confidences = torch.full((3, 4), 0.5)
    survival = prefix_survival(confidences, torch.tensor([0, 2, 4]))
    expected = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.0, 0.0], [0.5, 0.25, 0.125, 0.0625]])
    torch.testing.assert_close(survival, expected)


def test_tracker_starts_at_the_prior() -> None:
    tracker = AcceptanceTracker(max_num_positions=3, prior=0.6)
    assert tracker.conditional() == pytest.approx([0.6, 0.6, 0.6])
    survival = tracker.survival([2, 0, 3])
    assert [len(row) for row in survival] == [2, 0, 3]
    assert survival[0] == pytest.approx([0.6, 0.36])
    assert survival[2] == pytest.approx([0.6, 0.36, 0.216])


def test_tracker_counts_trials_only_up_to_the_first_rejection() -> None:
    tracker = AcceptanceTracker(max_num_positions=4, prior=0.5, decay=1.0)
    # r0: 3 drafted, 1 accepted -> trials at 0, 1 (successes: 0).
    # r1: 2 drafted, 2 accepted -> trials at 0, 1 (successes: 0, 1).
    # r2: 4 drafted, 0 accepted -> trial at 0 (no success).
    tracker.update(num_draft=[3, 2, 4], num_accepted=[1, 2, 0])
    # Prior adds 0.5 successes in 1 trial at every position.
    assert tracker.conditional() == pytest.approx([(0.5 + 2) / (1 + 3), (0.5 + 1) / (1 + 2), 0.5, 0.5])


def test_tracker_forgets_old_steps_with_decay() -> None:
    tracker = AcceptanceTracker(max_num_positions=1, prior=0.5, decay=0.5)
    for _ in range(30):
        tracker.update(num_draft=[1], num_accepted=[0])
    assert tracker.conditional()[0] < 1e-6
    for _ in range(30):
        tracker.update(num_draft=[1], num_accepted=[1])
    assert tracker.conditional()[0] > 1 - 1e-6


def test_tracker_survival_extends_past_the_tracked_positions() -> None:
    tracker = AcceptanceTracker(max_num_positions=2, prior=0.5)
    (survival,) = tracker.survival([4])
    assert survival == pytest.approx([0.5, 0.25, 0.125, 0.0625])


def test_tracker_rejects_inconsistent_counts() -> None:
    tracker = AcceptanceTracker(max_num_positions=2)
    with pytest.raises(ValueError):
        tracker.update(num_draft=[1], num_accepted=[2])
    with pytest.raises(ValueError):
        tracker.update(num_draft=[1, 2], num_accepted=[0])


def test_a_tracker_written_off_by_one_bad_round_tries_again() -> None:
    """One fully rejected round drops position 0 from the prior 0.7 to 0.35; steps with nothing verified (the
    scheduler declined) relax it back toward the prior, so the drafter is verified again, not written off."""
    tracker = AcceptanceTracker(max_num_positions=2, prior=0.7)
    tracker.update(num_draft=[7], num_accepted=[0])
    low = tracker.conditional()[0]
    assert low == pytest.approx(0.98 * 0.7 / (0.98 + 1))
    seen = [low]
    for _ in range(100):
        tracker.update(num_draft=[0], num_accepted=[0])  # nothing verified this step
        seen.append(tracker.conditional()[0])
    assert all(b > a for a, b in zip(seen, seen[1:]))  # rises step by step
    assert 0.6 < seen[-1] < 0.7  # most of the way back, never past the prior
    assert tracker.conditional()[1] == pytest.approx(0.7)  # never tried: stays at the prior
    # a drafter that keeps failing takes far longer to come back than one written off by a single round
    stubborn = AcceptanceTracker(max_num_positions=1, prior=0.7)
    for _ in range(200):
        stubborn.update(num_draft=[1], num_accepted=[0])
    for _ in range(100):
        stubborn.update(num_draft=[0], num_accepted=[0])
    assert stubborn.conditional()[0] < 0.2


def test_prefix_survival_rows_match_the_tensor_version_on_ragged_rows() -> None:
    rows = [[0.9, 0.5, 0.25], [], [0.8], [1.0, 0.0, 0.7]]
    width = max(map(len, rows))
    padded = torch.tensor([r + [0.0] * (width - len(r)) for r in rows])
    want = prefix_survival(padded, torch.tensor([len(r) for r in rows])).tolist()
    got = prefix_survival_rows(rows)
    assert [len(g) for g in got] == [len(r) for r in rows]
    for g, w in zip(got, want):
        assert g == pytest.approx(w[:len(g)], rel=1e-6)
