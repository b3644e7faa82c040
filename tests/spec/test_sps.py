"""SPSTable: interpolation, extrapolation, JSON round trip, validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.spec.sps import SPSTable


def test_step_time_interpolates_linearly_between_measured_points() -> None:
    table = SPSTable(tokens_per_step=[1, 4, 8], step_time_ms=[10.0, 16.0, 20.0])
    assert table.step_time_ms_at(4) == 16.0
    assert table.step_time_ms_at(2) == pytest.approx(12.0)
    assert table.step_time_ms_at(6) == pytest.approx(18.0)
    assert table.sps(6) == pytest.approx(1000.0 / 18.0)


def test_below_the_first_point_uses_the_first_point() -> None:
    table = SPSTable(tokens_per_step=[4, 8], step_time_ms=[10.0, 20.0])
    assert table.step_time_ms_at(1) == 10.0


def test_above_the_last_point_extrapolates_the_last_segment() -> None:
    table = SPSTable(tokens_per_step=[1, 4, 8], step_time_ms=[10.0, 16.0, 20.0])
    assert table.step_time_ms_at(12) == pytest.approx(24.0)


def test_extrapolation_never_drops_below_the_last_step_time() -> None:
    table = SPSTable(tokens_per_step=[1, 8], step_time_ms=[20.0, 10.0])
    assert table.step_time_ms_at(100) == 10.0
    single = SPSTable(tokens_per_step=[1], step_time_ms=[7.0])
    assert single.step_time_ms_at(50) == 7.0


def test_from_sps_converts_steps_per_second() -> None:
    table = SPSTable.from_sps({2: 0.5, 1: 1.0, 3: 0.45})
    assert table.tokens_per_step == [1, 2, 3]
    assert [table.sps(n) for n in (1, 2, 3)] == pytest.approx([1.0, 0.5, 0.45])


def test_file_round_trip(tmp_path: Path) -> None:
    table = SPSTable([1, 16, 64], [5.0, 6.5, 12.0], meta={"device": "cpu", "dtype": "float32"})
    path = tmp_path / "sps.json"
    table.save(path)
    assert json.loads(path.read_text()) == {
        "tokens_per_step": [1, 16, 64],
        "step_time_ms": [5.0, 6.5, 12.0],
        "meta": {"device": "cpu", "dtype": "float32"},
    }
    assert SPSTable.from_file(path) == table
    assert SPSTable.from_dict(table.to_dict()) == table


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tokens_per_step": [1, 2], "step_time_ms": [1.0]}, "entries"),
        ({"tokens_per_step": [1, 1], "step_time_ms": [1.0, 2.0]}, "ascending"),
        ({"tokens_per_step": [0, 1], "step_time_ms": [1.0, 2.0]}, ">= 1"),
        ({"tokens_per_step": [1, 2], "step_time_ms": [1.0, 0.0]}, "positive"),
        ({"tokens_per_step": [], "step_time_ms": []}, "at least one"),
        ({"tokens_per_step": [1]}, "missing"),
    ],
)
def test_invalid_profiles_raise_clear_errors(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SPSTable.from_dict(data)


def test_from_sps_rejects_non_positive_values() -> None:
    with pytest.raises(ValueError, match="positive"):
        SPSTable.from_sps({1: 1.0, 2: 0.0})


def test_monotone_fit_pools_dips_and_keeps_rising_profiles() -> None:
    jagged = SPSTable([1, 4, 6, 8, 16, 32], [70.0, 98.0, 127.0, 115.0, 118.0, 195.0], meta={"device": "cpu"})
    fitted = jagged.monotone()
    assert fitted.step_time_ms == pytest.approx([70.0, 98.0, 120.0, 120.0, 120.0, 195.0])
    assert fitted.tokens_per_step == jagged.tokens_per_step
    assert fitted.meta["device"] == "cpu" and fitted.meta["monotone"]
    assert all(a <= b for a, b in zip(fitted.step_time_ms, fitted.step_time_ms[1:]))
    rising = SPSTable([1, 8, 64], [5.0, 6.0, 12.0])
    assert rising.monotone().step_time_ms == rising.step_time_ms


@pytest.mark.parametrize("extra", [0, 3, 10, 63, 200])
def test_a_step_with_riding_prompts_is_the_table_shifted_by_their_tokens(extra: int) -> None:
    table = SPSTable([1, 8, 32, 64], [20.0, 25.0, 32.0, 51.0])
    shifted = table.with_base_tokens(extra)
    for n in (1, 2, 5, 22, 30, 54, 80, 500):
        assert shifted.step_time_ms_at(n) == pytest.approx(table.step_time_ms_at(n + extra))
    # one more token costs a step with prompts a smaller share of its time: the scheduler verifies more
    if extra:
        assert shifted.sps(9) / shifted.sps(8) > table.sps(9) / table.sps(8)


# measured in one run (SmolLM2 bf16, Zen 4): the single curve in chunks of 8 tokens, and per request count
ZEN4_LIKE = SPSTable([1, 8, 16, 32, 64], [13.2, 16.8, 23.8, 35.4, 61.3], by_requests={
    1: SPSTable([1, 2, 4, 8], [13.2, 13.6, 14.5, 16.8]),
    8: SPSTable([8, 16, 32, 64], [18.3, 24.5, 36.6, 61.3]),
    16: SPSTable([16, 32, 64, 128], [26.4, 40.1, 60.5, 113.3]),
    32: SPSTable([32, 64, 128, 256], [42.0, 65.8, 118.7, 223.5])})


def test_a_step_of_r_requests_reads_the_curve_measured_for_r_requests() -> None:
    """At a measured request count the curve itself; between two, their times at the same number of tokens past
    the requests' own blended linearly; past the last (or below the first), the nearest curve from its start."""
    assert SPSTable([1, 8], [10.0, 12.0]).for_requests(5).step_time_ms_at(9) == 12.0 + 2.0 / 7  # no curves: itself
    for r, curve in ZEN4_LIKE.by_requests.items():
        for n in (r, r + 3, 2 * r, 8 * r):
            assert ZEN4_LIKE.for_requests(r).step_time_ms_at(n) == pytest.approx(curve.step_time_ms_at(n))
    twelve = ZEN4_LIKE.for_requests(12)
    for extra in (0, 4, 12, 40):
        blend = 0.5 * ZEN4_LIKE.by_requests[8].step_time_ms_at(8 + extra) + \
            0.5 * ZEN4_LIKE.by_requests[16].step_time_ms_at(16 + extra)
        assert twelve.step_time_ms_at(12 + extra) == pytest.approx(blend)
    nearest = ZEN4_LIKE.by_requests[32].step_time_ms_at(36)
    assert ZEN4_LIKE.for_requests(40).step_time_ms_at(44) == pytest.approx(nearest)
    # 32 one-token requests cost more than the single curve's 32 tokens (4 requests of 8), and 8 tokens more add
    # a smaller share of that step: Algorithm 1 weighs a token by that share
    at32 = ZEN4_LIKE.for_requests(32)
    assert at32.step_time_ms_at(32) > ZEN4_LIKE.step_time_ms_at(32)
    single = ZEN4_LIKE.step_time_ms_at(40) / ZEN4_LIKE.step_time_ms_at(32)
    assert at32.step_time_ms_at(40) / at32.step_time_ms_at(32) < single


def test_per_request_curves_survive_the_file_the_monotone_fit_and_riding_prompts(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    ZEN4_LIKE.save(path)
    loaded = SPSTable.from_file(path)
    assert loaded.to_dict() == ZEN4_LIKE.to_dict() and set(loaded.by_requests) == {1, 8, 16, 32}
    jagged = SPSTable([1, 2], [1.0, 2.0], by_requests={4: SPSTable([4, 8, 16], [5.0, 4.0, 9.0])}).monotone()
    assert jagged.by_requests[4].step_time_ms == [4.5, 4.5, 9.0]
    shifted = ZEN4_LIKE.with_base_tokens(5)
    for r in (1, 8, 12, 32):
        for n in (r, r + 1, r + 7, 3 * r):
            later = ZEN4_LIKE.for_requests(r).step_time_ms_at(n + 5)
            assert shifted.for_requests(r).step_time_ms_at(n) == pytest.approx(later)
    with pytest.raises(ValueError, match="must start at >= 8 tokens"):
        SPSTable([1, 2], [1.0, 2.0], by_requests={8: SPSTable([4, 8], [1.0, 2.0])})
