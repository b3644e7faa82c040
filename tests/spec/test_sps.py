"""SPSTable: interpolation, extrapolation, JSON round trip, validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.spec.schedulers import GreedyEarlyStop
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


@pytest.mark.parametrize("prompt", [0, 3, 10, 63, 200])
def test_a_round_with_riding_prompts_prices_its_drafts_at_what_they_add_to_that_forward(prompt: int) -> None:
    table = SPSTable([1, 8, 32, 64], [20.0, 25.0, 32.0, 51.0])
    r = 4
    priced = table.with_riders(prompt, r)
    for n in (4, 5, 9, 22, 30, 54, 80, 500):  # T(r) + T(P + n) - T(P + r): a plain round plus what drafts add
        want = table.step_time_ms_at(r) + table.step_time_ms_at(prompt + n) - table.step_time_ms_at(prompt + r)
        assert priced.step_time_ms_at(n) == pytest.approx(want)


def test_beside_prompts_a_draft_is_verified_when_it_beats_the_plain_steps_tokens_per_ms() -> None:
    """T(n) = 10 + n ms: a plain round of 8 requests makes 8 tokens in 18 ms (0.44 a ms), a draft adds 1 ms. Beside
    100 prompt tokens the round takes 118 ms; on that step's own throughput (8 / 118 a ms) a draft that survives
    0.3 would look worth it, yet it buys 0.3 tokens a ms where plain steps make 0.44. Priced as `with_riders`
    prices it, only drafts that beat 0.44 tokens a ms are verified."""
    table = SPSTable([1, 64, 512], [11.0, 74.0, 522.0])
    priced = table.with_riders(100, 8)
    scheduler = GreedyEarlyStop()
    assert scheduler.schedule([[0.5]] + [[]] * 7, priced) == [1] + [0] * 7
    assert scheduler.schedule([[0.3]] + [[]] * 7, priced) == [0] * 8
    shifted_only = SPSTable([1, 412], [111.0, 522.0])  # the step's own table, T(100 + n): verifies the 0.3
    assert scheduler.schedule([[0.3]] + [[]] * 7, shifted_only) == [1] + [0] * 7


def _with_rows() -> SPSTable:
    """A one-request table whose T(16) -> T(20) jumps (chunks of 8 tokens), and rows of batched steps where a
    verified draft adds little."""
    return SPSTable([1, 2, 4, 8, 16, 20, 32, 64], [10.0, 11.0, 12.0, 13.0, 15.8, 22.0, 24.6, 43.0],
                    by_requests={8: SPSTable([8, 9, 10, 12, 16], [14.8, 14.8, 14.9, 15.0, 15.2]),
                                 16: SPSTable([16, 17, 18, 20, 24, 32], [16.0, 16.1, 16.4, 16.7, 18.4, 21.1])})


def test_a_step_of_r_requests_is_priced_on_its_own_row() -> None:
    table = _with_rows()
    assert table.for_requests(1) is table and SPSTable([1, 2], [1.0, 2.0]).for_requests(16).step_time_ms == [1.0, 2.0]
    sixteen = table.for_requests(16)
    assert sixteen.step_time_ms_at(16) == pytest.approx(16.0) and sixteen.step_time_ms_at(20) == pytest.approx(16.7)
    # past the row's last point: that point plus the one-request table's own growth from there
    assert sixteen.step_time_ms_at(64) == pytest.approx(21.1 + 43.0 - 24.6)
    assert table.for_requests(16) is sixteen  # built once per size


def test_between_rows_the_table_interpolates_at_the_same_number_of_drafts() -> None:
    twelve = _with_rows().for_requests(12)
    assert twelve.step_time_ms_at(12) == pytest.approx((14.8 + 16.0) / 2)  # 0 drafts
    assert twelve.step_time_ms_at(16) == pytest.approx((15.0 + 16.7) / 2)  # 4 drafts: T8(12), T16(20)
    # below the smallest row: between one request's steps (this table) and it
    four = _with_rows().for_requests(4)
    assert four.step_time_ms_at(4) == pytest.approx(10.0 + 3 / 7 * (14.8 - 10.0))
    # past the largest row: the largest row, shifted by what this table adds from its size to this one
    thirty_two = _with_rows().for_requests(32)
    assert thirty_two.step_time_ms_at(32) == pytest.approx(16.0 + 24.6 - 15.8)


def test_rows_round_trip_are_made_monotone_and_are_validated(tmp_path: Path) -> None:
    table = _with_rows()
    table.save(tmp_path / "p.json")
    loaded = SPSTable.from_file(tmp_path / "p.json")
    assert loaded.for_requests(12).step_time_ms == table.for_requests(12).step_time_ms
    dipping = SPSTable([1, 8], [1.0, 2.0], by_requests={8: SPSTable([8, 9, 10], [3.0, 2.0, 4.0])}).monotone()
    assert dipping.by_requests[8].step_time_ms == [2.5, 2.5, 4.0]
    with pytest.raises(ValueError, match="r >= 2"):
        SPSTable([1], [1.0], by_requests={8: SPSTable([4, 8], [1.0, 2.0])})
    with pytest.raises(ValueError, match="by_requests needs"):
        SPSTable.from_dict({"tokens_per_step": [1], "step_time_ms": [1.0], "by_requests": {"8": {"tokens": [8]}}})
