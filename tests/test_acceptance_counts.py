"""Position-wise conditional acceptance and the rounds behind it (paper Fig. 2), on hand-computed cases."""

from __future__ import annotations

import pytest

from dspark.bench.plots import MIN_REACHED, pooled_acceptance, reached_counts
from dspark.training.evaluate import Rounds


def test_rounds_count_who_reached_each_position():
    # five rounds of a γ=3 block; the last one was cut to 2 verified tokens at the end of its request
    r = Rounds(num_verified=[3, 3, 3, 3, 2], num_accepted=[0, 1, 3, 2, 2])
    assert r.reached(3) == [5, 4, 2]  # k=3: rounds with ≥2 accepted and 3 verified
    assert r.conditional_acceptance(3) == pytest.approx([4 / 5, 3 / 4, 1 / 2])
    assert r.tau == pytest.approx((0 + 1 + 3 + 2 + 2 + 5) / 5)


def test_reached_counts_prefers_the_report_and_derives_it_for_old_reports():
    assert reached_counts({"reached": [9, 4], "num_rounds": 9, "conditional_acceptance": [0.5, 0.5]}) == [9, 4]
    old = {"num_rounds": 100, "conditional_acceptance": [0.5, 0.2, None]}
    assert reached_counts(old) == pytest.approx([100, 50, 10])


def test_pooling_weights_by_rounds_reached_and_drops_thin_positions():
    a = {"num_rounds": 100, "reached": [100, 40, MIN_REACHED - 1], "conditional_acceptance": [0.4, 0.5, 1.0]}
    b = {"num_rounds": 300, "reached": [300, 60, 0], "conditional_acceptance": [0.2, 0.0, None]}
    xs, ys = pooled_acceptance([a, b])
    assert xs == [1, 2]  # position 3 rests on MIN_REACHED - 1 rounds: not drawn
    assert ys == pytest.approx([(40 + 60) / 400, 20 / 100])
