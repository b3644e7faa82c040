"""The SPS profile a replica measures at start-up on an unknown machine: fast steps get more rounds (their
median drops a burst of noise), slow ones stop after the minimum; the result is a loadable, positive table."""

from __future__ import annotations

from dspark.kernels import native
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


def test_a_profile_measured_here_is_kept_per_kernel_build_and_found_again(tiny_target, tmp_path,
                                                                           monkeypatch) -> None:
    """An unknown machine measures its profile once, into the folder of the native kernels' build: the next
    engine finds it there; a rebuilt kernel (another build) does not, and measures its own curve."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setenv("DSPARK_PROFILES_DIR", str(tmp_path / "nothing-shipped"))
    table, path = profiles.profile_for(tiny_target)
    assert path.parent == profiles.measured_dir() and path.parent.name == (native.build_id() or "pytorch")
    again, same = profiles.profile_for(tiny_target)
    assert same == path and again.step_time_ms == table.step_time_ms
    identity = profiles.machine_identity(tiny_target.name, tiny_target.device, tiny_target.dtype)
    monkeypatch.setattr(native, "build_id", lambda: "another-build")
    assert profiles.find_profile(identity) is None
