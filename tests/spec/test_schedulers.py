"""Verification-length schedulers: FixedK, Threshold, Algorithm 1, async capacity."""

from __future__ import annotations

import random

import pytest

from dspark.spec.schedulers import (
    SCHEDULER_NAMES,
    AsyncCapacity,
    FixedK,
    GlobalSearch,
    GreedyEarlyStop,
    Threshold,
    make_scheduler,
)
from dspark.spec.sps import SPSTable

FLAT_SPS = SPSTable(tokens_per_step=[1, 1024], step_time_ms=[10.0, 10.5])  # light load
STEEP_SPS = SPSTable(tokens_per_step=[1, 2], step_time_ms=[10.0, 20.0])  # time ~ tokens
APPENDIX_SPS = SPSTable.from_sps({1: 1.0, 2: 0.5, 3: 0.45})
HIGH_TABLE = [[0.8, 0.72]]  # global argmax verifies 2 under APPENDIX_SPS
LOW_TABLE = [[0.8, 0.0]]  # global argmax verifies 0


def test_fixed_k_caps_at_the_proposed_length() -> None:
    survival = [[0.9, 0.5, 0.1], [], [0.2]]
    assert FixedK(2).schedule(survival, FLAT_SPS) == [2, 0, 1]
    assert FixedK(0).schedule(survival, FLAT_SPS) == [0, 0, 0]


def test_threshold_keeps_the_prefix_at_or_above_the_threshold() -> None:
    survival = [[0.9, 0.5, 0.1], [0.2, 0.1], [0.5, 0.5, 0.5]]
    assert Threshold(0.5).schedule(survival, STEEP_SPS) == [2, 0, 3]


def test_greedy_verifies_long_prefixes_under_light_load() -> None:
    survival = [[0.9, 0.8, 0.6, 0.3], [0.7, 0.4], [0.5, 0.25, 0.1]]
    assert GreedyEarlyStop().schedule(survival, FLAT_SPS) == [4, 2, 3]


def test_greedy_prunes_everything_when_step_time_grows_with_tokens() -> None:
    # Theta = tau / B: any token with survival < 1 lowers it.
    survival = [[0.9, 0.8, 0.6, 0.3], [0.7, 0.4]]
    assert GreedyEarlyStop().schedule(survival, STEEP_SPS) == [0, 0]


def test_greedy_admits_in_descending_survival_across_requests() -> None:
    # Step time 10 ms up to 4 tokens, then a cliff: with 2 requests, 2 drafts fit for free.
    sps = SPSTable(tokens_per_step=[1, 4, 5], step_time_ms=[10.0, 10.0, 100.0])
    survival = [[0.9, 0.5], [0.95, 0.6]]
    assert GreedyEarlyStop().schedule(survival, sps) == [1, 1]


def test_greedy_stops_at_the_first_drop_even_if_a_later_peak_exists() -> None:
    # Jagged curve: one token costs a step-time jump, three more are free afterwards.
    jagged = SPSTable(tokens_per_step=[1, 2, 5], step_time_ms=[10.0, 20.0, 20.0])
    survival = [[0.95, 0.9, 0.85, 0.8]]
    assert GreedyEarlyStop().schedule(survival, jagged) == [0]
    assert GlobalSearch().schedule(survival, jagged) == [4]


def test_empty_batch_schedules_nothing() -> None:
    for name in (*SCHEDULER_NAMES, "global_search"):
        assert make_scheduler(name).schedule([], FLAT_SPS) == []


def test_async_uses_greedy_before_history_exists() -> None:
    scheduler = AsyncCapacity(delay_steps=2)
    assert scheduler.schedule(HIGH_TABLE, APPENDIX_SPS) == [0]  # Algorithm 1 stops at once
    assert scheduler.schedule(HIGH_TABLE, APPENDIX_SPS) == [0]


def test_async_uses_the_fallback_capacity_before_history_exists() -> None:
    scheduler = AsyncCapacity(delay_steps=2, fallback_capacity=3)
    survival = [[0.9, 0.3], [0.5, 0.4]]
    assert scheduler.schedule(survival, STEEP_SPS) == [1, 2]  # top-3: 0.9, 0.5, 0.4


def test_async_takes_capacity_from_the_table_two_steps_back() -> None:
    scheduler = AsyncCapacity(delay_steps=2)
    scheduler.schedule(HIGH_TABLE, APPENDIX_SPS)  # step 0: K_0 = 2 recorded
    scheduler.schedule(LOW_TABLE, APPENDIX_SPS)  # step 1: K_1 = 0 recorded
    # Step 2: the current table alone would give 0 (greedy and global search agree), but
    # K = K_0 = 2; only one candidate has survival > 0, so one draft is verified.
    assert GlobalSearch().schedule(LOW_TABLE, APPENDIX_SPS) == [0]
    assert scheduler.schedule(LOW_TABLE, APPENDIX_SPS) == [1]
    # Step 3: the current table alone would give 2, but K = K_1 = 0.
    assert GlobalSearch().schedule(HIGH_TABLE, APPENDIX_SPS) == [2]
    assert scheduler.schedule(HIGH_TABLE, APPENDIX_SPS) == [0]


def test_async_skips_steps_that_drafted_nothing() -> None:
    # steps the draft gate skipped carry empty tables: they verify nothing and leave the history alone,
    # so the next drafted step (a probe) verifies what the last drafted tables said it could
    scheduler = AsyncCapacity(delay_steps=2)
    scheduler.schedule(HIGH_TABLE, APPENDIX_SPS)
    scheduler.schedule(HIGH_TABLE, APPENDIX_SPS)
    for _ in range(5):
        assert scheduler.schedule([[]], APPENDIX_SPS) == [0]
    assert scheduler.schedule(HIGH_TABLE, APPENDIX_SPS) == [2]


def test_async_capacity_is_a_token_count_across_batch_sizes() -> None:
    scheduler = AsyncCapacity(delay_steps=1)
    scheduler.schedule([[0.95, 0.9, 0.85]], FLAT_SPS)  # K = 3 from a one-request table
    survival = [[0.9, 0.2], [0.8, 0.7], [0.3]]
    assert scheduler.schedule(survival, STEEP_SPS) == [1, 2, 0]  # top-3: 0.9, 0.8, 0.7


def test_async_crosses_sps_cliffs_that_stop_algorithm_1() -> None:
    jagged = SPSTable(tokens_per_step=[1, 2, 5], step_time_ms=[10.0, 20.0, 20.0])
    survival = [[0.95, 0.9, 0.85, 0.8]]
    scheduler = AsyncCapacity(delay_steps=1)
    assert scheduler.schedule(survival, jagged) == [0]  # no history: Algorithm 1
    assert scheduler.schedule(survival, jagged) == [4]


def test_async_selections_are_prefix_closed_top_k_by_current_survival() -> None:
    rng = random.Random(0)
    sps = SPSTable(tokens_per_step=[1, 8, 16, 64], step_time_ms=[10.0, 11.0, 13.0, 40.0])
    scheduler = AsyncCapacity(delay_steps=2)
    for _ in range(200):
        survival = []
        for _ in range(rng.randint(1, 6)):
            row, a = [], 1.0
            for _ in range(rng.randint(0, 5)):
                a *= rng.choice([1.0, 0.9, 0.5, rng.random()])  # ties included
                row.append(a)
            survival.append(row)
        lengths = scheduler.schedule(survival, sps)
        selected = [a for row, n in zip(survival, lengths, strict=True) for a in row[:n]]
        skipped = [a for row, n in zip(survival, lengths, strict=True) for a in row[n:]]
        assert all(0 <= n <= len(row) for row, n in zip(survival, lengths, strict=True))
        if selected and skipped:
            assert min(selected) >= max(skipped)


def test_make_scheduler_builds_by_name_with_defaults() -> None:
    assert SCHEDULER_NAMES == ("fixed", "threshold", "greedy", "async")
    fixed = make_scheduler("fixed")
    assert isinstance(fixed, FixedK) and fixed.k == 7
    threshold = make_scheduler("threshold")
    assert isinstance(threshold, Threshold) and threshold.threshold == 0.3
    assert isinstance(make_scheduler("greedy"), GreedyEarlyStop)
    asynchronous = make_scheduler("async", delay_steps=3)
    assert isinstance(asynchronous, AsyncCapacity) and asynchronous.delay_steps == 3
    assert isinstance(make_scheduler("global_search"), GlobalSearch)
    assert make_scheduler("fixed", k=2).name == "fixed"


def test_make_scheduler_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match="valid names: fixed, threshold, greedy, async"):
        make_scheduler("oracle")
    with pytest.raises(ValueError, match="bad options"):
        make_scheduler("greedy", k=3)
