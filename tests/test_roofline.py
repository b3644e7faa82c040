"""`dspark bench roofline` on a tiny target: every part measured, the machine's dtypes by default, the wall
time reported, and the figures consistent with each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark.cli import app
from dspark.models.target.dtype_choice import candidate_dtypes


def test_roofline_measures_this_machines_dtypes_and_reports_its_wall_time(tiny_target_dir: Path) -> None:
    res = CliRunner().invoke(app, ["bench", "roofline", "--target", str(tiny_target_dir), "--batch-sizes", "1,8",
                                   "--context-len", "16", "--num-threads", "1"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # by default only the dtypes with a fast path here: bf16 only where the CPU has bf16 units
    assert out["dtypes"] == candidate_dtypes("cpu") and set(out["by_dtype"]) == set(out["dtypes"])
    assert out["wall_s"] > 0
    for body in out["by_dtype"].values():
        roof = body["gemm_roofline"]
        assert [int(r) for r in roof] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        assert all(r["gflop_s"] == max(r["by_kernel"].values()) > 0 for r in roof.values())
        assert set(body["decode"]) == {"1", "8"}
        for d in body["decode"].values():
            assert d["step_ms"] > 0 and d["fraction_of_roofline"] > 0
            assert d["achieved_gflop_s"] == pytest.approx(body["flops_per_token"] * d["tok_s"] / 1e9, rel=0.02, abs=0.2)
        assert body["memory_floor_ms"] > 0 and body["batch1_over_memory_floor"] > 0
