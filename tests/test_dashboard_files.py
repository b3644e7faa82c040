"""The committed Grafana JSON is what the code generates, and every panel queries metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dspark.metrics.dashboards import BOARDS, all_queries, dashboard_json
from dspark.metrics.series import SPECS

GRAFANA_DIR = Path(__file__).resolve().parents[1] / "configs" / "grafana"
_NAME = re.compile(r"\b(vllm:[a-z0-9_]+|dspark_[a-z0-9_]+)")


def _spec_of(series: str) -> str | None:
    for name in (series, *(series.removesuffix(s) for s in ("_bucket", "_sum", "_count"))):
        if name in SPECS:
            return name
    return None


def test_committed_dashboards_are_the_generated_ones() -> None:
    for board in BOARDS:
        committed = json.loads((GRAFANA_DIR / f"{board.uid}.json").read_text())
        assert committed == dashboard_json(board), f"run `dspark dashboard build`: {board.uid} is stale"
    assert (GRAFANA_DIR / "provisioning.yaml").exists()


def test_every_panel_query_names_only_exported_metrics() -> None:
    queries = all_queries()
    assert len(queries) >= 30
    for uid, title, expr in queries:
        names = _NAME.findall(expr)
        assert names, f"{uid}/{title}: no metric in {expr}"
        unknown = [n for n in names if _spec_of(n) is None]
        assert not unknown, f"{uid}/{title}: {unknown} are not in metrics/series.py"
