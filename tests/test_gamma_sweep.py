"""The γ sweep (Fig. 4) from `dspark eval` reports: the table, the ratio, and `dspark compare --gamma-sweep`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspark.bench.gamma_sweep import gamma_sweep
from dspark.cli import app


def report(kind: str, gamma: int, tau_math: float, tau_chat: float) -> dict:
    """The part of a `dspark eval` report the sweep and `compare` read (one dataset per domain)."""
    per = {"gsm8k": {"tau": tau_math, "domain": "math", "num_rounds": 10, "conditional_acceptance": [0.5] * gamma},
           "mt-bench": {"tau": tau_chat, "domain": "chat", "num_rounds": 10, "conditional_acceptance": [0.4] * gamma}}
    run = {"tau": {k: v["tau"] for k, v in per.items()}, "tau_macro": (tau_math + tau_chat) / 2,
           "tau_by_domain": {"math": tau_math, "chat": tau_chat}, "per_dataset": per}
    return {"drafter": f"{kind}_g{gamma}", "kind": kind, "gamma": gamma, "runs": {"1.0": run}}


REPORTS = {"dspark_g4": report("dspark", 4, 2.0, 1.6), "dspark_g8": report("dspark", 8, 2.6, 1.8),
           "dflash_g4": report("dflash", 4, 1.8, 1.4), "dflash_g8": report("dflash", 8, 2.0, 1.6)}


def test_sweep_groups_by_kind_and_gamma_and_divides_per_gamma():
    sweep = gamma_sweep(REPORTS)
    assert sweep["tau_macro"] == {"dspark": {4: 1.8, 8: 2.2}, "dflash": {4: 1.6, 8: 1.8}}
    assert sweep["ratio"] == pytest.approx({4: 1.8 / 1.6, 8: 2.2 / 1.8})
    assert sweep["tau_by_domain"]["dflash"][8] == {"math": 2.0, "chat": 1.6}


def test_sweep_refuses_two_reports_at_one_gamma_and_a_missing_temperature():
    with pytest.raises(ValueError, match="second dspark report at γ=4"):
        gamma_sweep({**REPORTS, "dspark_rnn": report("dspark", 4, 1.0, 1.0)})
    with pytest.raises(ValueError, match="no run at T=0.0"):
        gamma_sweep(REPORTS, "0.0")


def test_compare_gamma_sweep_prints_the_table_and_draws_fig4(tmp_path):
    paths = []
    for label, rep in REPORTS.items():
        paths.append(tmp_path / f"eval_{label}.json")
        paths[-1].write_text(json.dumps(rep))
    res = CliRunner().invoke(app, ["compare", *map(str, paths), "--gamma-sweep", "--out", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["gamma_sweep"]["ratio"] == pytest.approx({"4": 1.8 / 1.6, "8": 2.2 / 1.8})
    assert (tmp_path / "c_gamma.png").stat().st_size > 0 and (tmp_path / "c.png").stat().st_size > 0
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps({**report("dspark", 8, 1.0, 1.0), "drafter": "dspark_rnn"}))
    res = CliRunner().invoke(app, ["compare", *map(str, paths), str(dup), "--gamma-sweep", "--out",
                                   str(tmp_path / "d.png")])
    assert res.exit_code == 2 and "one report per drafter and γ" in res.output
