"""The SPS profile a replica measures at start-up on an unknown machine: fast steps get more rounds (their
median drops a burst of noise), slow ones stop after the minimum; the result is a loadable, positive table."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.kernels import native
from dspark.kernels.machine import cpu_signature, same_cpu
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


def test_a_profile_names_the_cpus_family_and_model_and_is_found_only_on_that_one(tmp_path) -> None:
    """Two CPUs with one model name and the same flags (a Zen 4 and a Zen 5 EPYC under a hypervisor) have different
    step curves: a profile recorded with CPUID family and model serves only that microarchitecture, one recorded
    before they were (name and flags only) serves any CPU of that name when nothing closer is shipped."""
    here = {"model": "AMD EPYC", "flags": ["avx2", "avx512f", "avx512_bf16"], "cpuid": "26-2"}
    identity = {"hardware": here, "model": "smollm2", "dtype": "bfloat16", "device": "cpu", "num_threads": 2}

    def write(name: str, hardware: dict) -> Path:
        path = tmp_path / name
        meta = {**identity, "hardware": hardware}
        path.write_text(json.dumps({"tokens_per_step": [1, 8], "step_time_ms": [10.0, 13.0], "meta": meta}))
        return path

    zen4 = write("a-zen4.json", {**here, "cpuid": "25-17"})
    assert profiles.find_profile(identity, [tmp_path]) is None
    older = write("b-older.json", {k: v for k, v in here.items() if k != "cpuid"})
    assert profiles.find_profile(identity, [tmp_path]) == older
    zen5 = write("c-zen5.json", here)
    assert profiles.find_profile(identity, [tmp_path]) == zen5  # the exact one, though another sorts first
    assert profiles.find_profile({**identity, "hardware": {**here, "cpuid": "25-17"}}, [tmp_path]) == zen4
    assert profiles.find_profile({**identity, "num_threads": 1}, [tmp_path]) is None
    assert "f26m2" in profiles.slug(identity) and "f25m17" not in profiles.slug(identity)


def test_this_cpus_signature_is_matched_by_itself() -> None:
    sig = cpu_signature()
    assert same_cpu(sig, sig) and same_cpu({k: v for k, v in sig.items() if k != "cpuid"}, sig)
    assert not same_cpu({**sig, "cpuid": "0-0"}, sig) and not same_cpu({**sig, "model": "another"}, sig)
