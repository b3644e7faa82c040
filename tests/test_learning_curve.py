"""The learning curve's continuation and forecast (`dspark train-curve`): pure functions over curve points."""

from __future__ import annotations

import math

import pytest

from dspark.training.curve import continue_curve, forecast, tau_estimate


def _points(taus_and_tokens: list[tuple[float, int]], step0: int = 0) -> list[dict]:
    return [{"step": step0 + 100 * (i + 1), "loss": 2.0, "tau_est_T1": tau, "acceptance": [],
             "train_tokens": tokens} for i, (tau, tokens) in enumerate(taus_and_tokens)]


def test_forecast_recovers_a_log_linear_trend_and_the_tokens_each_target_would_take() -> None:
    tokens = [100_000 * 2 ** i for i in range(8)]
    pts = _points([(1.2 + 0.15 * math.log2(t / 100_000), t) for t in tokens])
    fc = forecast(pts, (2.0, 3.0))
    assert fc["tau_per_doubling"] == pytest.approx(0.15, abs=1e-4)
    # τ 3.0 is 1.8 above the line's value at 1e5 tokens: 12 doublings
    assert fc["tokens_for_tau"]["3"] == pytest.approx(100_000 * 2 ** 12, rel=1e-3)
    assert fc["tokens_for_tau"]["2"] == pytest.approx(100_000 * 2 ** (0.8 / 0.15), rel=1e-3)
    assert fc["fit_from_tokens"] == tokens[4]  # the later half only: warm-up steps would bend the fit
    flat = forecast(_points([(1.5, 1000 * 2 ** i) for i in range(6)] + [(1.4, 10 ** 6), (1.4, 2 * 10 ** 6)]), (3.0,))
    assert flat["tau_per_doubling"] <= 0 and flat["tokens_for_tau"]["3"] is None
    with pytest.raises(ValueError, match="at least 4"):
        forecast(_points([(1.1, 100)]))


def test_a_continued_run_counts_on_from_the_run_it_continues() -> None:
    previous = {"points": _points([(1.5, 1_000_000), (1.7, 2_000_000)])}
    curve = {"num_steps": 200, "points": _points([(1.72, 50_000), (1.75, 100_000)])}
    more = continue_curve(curve, previous)
    assert [p["step"] for p in more["points"]] == [300, 400]
    assert [p["train_tokens"] for p in more["points"]] == [2_050_000, 2_100_000]
    assert more["continues_from"] == {"step": 200, "train_tokens": 2_000_000}
    assert more["previous"] == previous["points"] and curve["points"][0]["step"] == 100  # input untouched


def test_tau_estimate_is_one_plus_the_survival_products() -> None:
    assert tau_estimate([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert tau_estimate([]) == 1.0
