"""A round's time beside its forward (spec/round_cost.py): a decayed mean per batch size, and the step-time table
Algorithm 1 reads it through (T(n) + F(B)): one more token is then a smaller share of the step, so more is verified."""

from __future__ import annotations

import pytest

from dspark.spec.round_cost import RoundCost
from dspark.spec.schedulers import GreedyEarlyStop
from dspark.spec.sps import SPSTable


def test_the_round_cost_is_a_decayed_mean_per_batch_size_read_at_the_nearest_one_measured() -> None:
    cost = RoundCost(decay=0.5)
    assert cost.fixed_ms(4) == 0.0  # nothing measured: the forward alone
    cost.record(4, 2.0)
    cost.record(4, 4.0)
    assert cost.fixed_ms(4) == pytest.approx(3.0)
    cost.record(16, -1.0)  # a round timed shorter than its forward (clock granularity): no negative cost
    assert cost.fixed_ms(16) == 0.0
    cost.record(16, 6.0)
    assert cost.fixed_ms(16) == pytest.approx(3.0)
    cost.record(8, 5.0)
    assert cost.fixed_ms(6) == pytest.approx(3.0)  # as far from 4 as from 8: the smaller
    assert cost.fixed_ms(7) == pytest.approx(5.0)
    assert cost.fixed_ms(64) == pytest.approx(3.0)


@pytest.mark.parametrize("fixed", [0.0, 0.5, 3.0, 40.0])
def test_a_round_with_fixed_time_is_the_table_plus_that_time(fixed: float) -> None:
    table = SPSTable([1, 8, 32, 64], [20.0, 25.0, 32.0, 51.0])
    whole = table.with_fixed_ms(fixed)
    for n in (1, 2, 5, 22, 30, 54, 80, 500):
        assert whole.step_time_ms_at(n) == pytest.approx(table.step_time_ms_at(n) + fixed)
    if fixed:
        assert whole.meta["fixed_ms"] == fixed
        assert whole.sps(9) / whole.sps(8) > table.sps(9) / table.sps(8)


def test_algorithm_1_verifies_more_when_the_round_costs_more_than_its_forward() -> None:
    # 16 requests, a forward of n tokens n ms: a token of survival 0.8 adds 0.8 / 16 = 5 % to the tokens and costs
    # 1 / 16 (6.25 %) of the forward alone (not verified), 1 / 22 (4.5 %) of a round with 6 ms beside it (verified)
    forward = SPSTable([1, 16, 64], [1.0, 16.0, 64.0])
    survival = [[0.8, 0.3]] + [[]] * 15
    assert GreedyEarlyStop().schedule(survival, forward) == [0] + [0] * 15
    assert GreedyEarlyStop().schedule(survival, forward.with_fixed_ms(6.0)) == [1] + [0] * 15
