"""The SPS profile a replica measures at start-up on an unknown machine: fast steps get more rounds (their
median drops a burst of noise), slow ones stop after the minimum; the result is a loadable, positive table."""

from __future__ import annotations

from dspark.models.target import profiles
from dspark.models.target.profiles import measure_startup_profile, profile_target


def test_fast_steps_are_timed_for_more_rounds_until_the_time_budget(tiny_target) -> None:
    grid = (1, 4, 16)
    quick = profile_target(tiny_target, grid, context_len=16, num_repeats=3, num_warmup=1, show_progress=False)
    assert quick.meta["num_repeats"] == 3  # no budget: exactly the rounds asked for
    longer = profile_target(tiny_target, grid, context_len=16, num_repeats=3, num_warmup=1, show_progress=False,
                            min_time_s=0.3, max_repeats=40)
    # a tiny model's step takes about a millisecond: 3 rounds fit in 0.3 s many times over, 40 do not
    assert 3 < longer.meta["num_repeats"] <= 40
    assert longer.tokens_per_step == list(grid) and all(t > 0 for t in longer.step_time_ms)


def test_startup_profile_times_an_odd_number_of_rounds_and_names_the_machine(tiny_target) -> None:
    table = measure_startup_profile(tiny_target)
    assert table.tokens_per_step == list(profiles.STARTUP_GRID)
    assert profiles.STARTUP_REPEATS <= table.meta["num_repeats"] <= profiles.STARTUP_MAX_REPEATS
    assert profiles.STARTUP_REPEATS % 2 == 1
    assert table.meta["measured_at_startup_s"] < 60 and table.meta["dtype"] == "float32"
    assert table.monotone().step_time_ms == sorted(table.monotone().step_time_ms)
