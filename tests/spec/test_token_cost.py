"""The measured cost of one more verified token (spec/token_cost.py): fitted from rounds, clamped to the
profile's slope, and what Algorithm 1 then verifies."""

from __future__ import annotations

import random

import pytest

from dspark.spec.schedulers import GreedyEarlyStop
from dspark.spec.sps import SPSTable
from dspark.spec.token_cost import TokenCost, band_of

# a profile's shape: ~0.6 ms per token past 32 (SmolLM2 bf16, 1 thread)
PROFILE = SPSTable([1, 8, 16, 32, 64, 128], [33.0, 36.0, 41.0, 55.0, 75.0, 115.0])


def feed(cost: TokenCost, batch: int, slope_ms: float, rounds: int, seed: int = 0) -> None:
    """Rounds at `batch`: one plain in four, the others verifying 10-40 draft tokens, each at `slope_ms`, on top
    of the profile's plain time plus 3 ms the profile does not know of, with ±1 ms noise."""
    rng = random.Random(seed)
    for i in range(rounds):
        verified = 0 if i % 4 == 0 else rng.randint(10, 40)
        cost.record(batch, verified, PROFILE.step_time_ms_at(batch) + 3.0 + slope_ms * verified + rng.uniform(-1, 1),
                    PROFILE)


def test_bands_group_batch_sizes_by_powers_of_two():
    assert [band_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]


def test_the_profile_stands_until_a_band_has_rounds_enough_then_the_measured_slope():
    cost = TokenCost()
    assert cost.table(32, PROFILE) is PROFILE
    feed(cost, 32, 1.5, rounds=cost.min_rounds - 1)
    assert cost.table(32, PROFILE) is PROFILE  # too few rounds to fit on
    feed(cost, 32, 1.5, rounds=60, seed=1)
    slope, measured = cost.slope_ms(30, PROFILE)  # the same band
    assert measured and slope == pytest.approx(1.5, abs=0.1)
    table = cost.table(30, PROFILE)
    # the plain time: the profile's plus the 3 ms it does not know of (the line's intercept)
    assert table.step_time_ms_at(30) == pytest.approx(PROFILE.step_time_ms_at(30) + 3.0, abs=0.5)
    assert table.step_time_ms_at(50) - table.step_time_ms_at(30) == pytest.approx(20 * slope)
    assert cost.slope_ms(4, PROFILE)[1] is False  # another band: nothing measured there
    assert cost.summary(PROFILE)["32"]["measured"]


def test_a_wild_fit_is_clamped_to_the_profiles_slope():
    cost = TokenCost()
    feed(cost, 32, 50.0, rounds=60)
    slope, _ = cost.slope_ms(32, PROFILE)
    profile_slope = (PROFILE.step_time_ms_at(64) - PROFILE.step_time_ms_at(32)) / 32
    assert slope == pytest.approx(4.0 * profile_slope)
    alike = TokenCost()
    for _ in range(60):  # every round verified the same number of tokens: no slope to fit
        alike.record(32, 20, 90.0, PROFILE)
    assert alike.slope_ms(32, PROFILE)[1] is False


def test_algorithm_1_verifies_only_what_pays_at_the_measured_cost():
    survival = [[0.9, 0.6, 0.35]] * 32  # batch 32: one token each of survival 0.9, 0.6, 0.35
    on_profile = GreedyEarlyStop().schedule(survival, PROFILE)
    cost = TokenCost()
    feed(cost, 32, 1.5, rounds=80)
    measured = GreedyEarlyStop().schedule(survival, cost.table(32, PROFILE))
    # at the profile's 0.6 ms a token pays above survival ~0.35 (rate 32 tok / 55 ms), at 1.5 ms above ~0.87
    assert sum(on_profile) > sum(measured) >= 32
    assert all(n == 1 for n in measured)
