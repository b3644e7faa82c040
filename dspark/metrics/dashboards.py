"""The Grafana dashboards, generated from code (grafanalib): `dspark dashboard build` writes them under
configs/grafana/, `dspark dashboard push` provisions them through Grafana's HTTP API.

Every panel is a list of PromQL queries over the names `GET /metrics` exports (metrics.py); the test
`tests/test_prometheus_dashboards.py` runs each of them on a real Prometheus scraping a real cluster.
Variables: `$model_name` and `$arm` (multi-select, All), `$__rate_interval` (Grafana's own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

DATASOURCE = "${datasource}"
SEL = 'model_name=~"$model_name",arm=~"$arm"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = ""
    description: str = ""


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    panels: list[Panel] = field(default_factory=list)


def _q(p: float, metric: str, by: str = "arm") -> str:
    return f"histogram_quantile({p}, sum by (le, {by}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))"


def _ratio(num: str, den: str, by: str = "arm") -> str:
    return f"sum by ({by}) (rate({num}{{{SEL}}}[{RATE}])) / sum by ({by}) (rate({den}{{{SEL}}}[{RATE}]))"


SPEC = Board("dspark-spec", "dspark: speculative decoding", [
    Panel("Acceptance rate (accepted / verified draft tokens)", [
        (_ratio("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
         "{{arm}}")], "percentunit"),
    Panel("τ: tokens per verification round (accepted + 1)", [
        ("1 + " + _ratio("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"),
         "{{arm}}")]),
    Panel("Acceptance by position (of rounds)", [
        (f"sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{{{SEL}}}[{RATE}])) "
         f"/ scalar(sum(rate(vllm:spec_decode_num_drafts_total{{{SEL}}}[{RATE}])))", "pos {{position}}")],
        "percentunit"),
    Panel("Verification length ℓ per request and round", [
        (_ratio("dspark_verification_length_sum", "dspark_verification_length_count"), "mean {{arm}}"),
        (_q(0.9, "dspark_verification_length"), "p90 {{arm}}")]),
    Panel("Capacity K per verify replica", [
        (f"max by (arm, replica) (dspark_capacity_k{{{SEL}}})", "{{arm}} {{replica}}")]),
    Panel("Live calibration: predicted vs observed prefix survival", [
        (_ratio("dspark_predicted_survival_total", "dspark_verified_positions_total", "position"),
         "predicted pos {{position}}"),
        (_ratio("dspark_observed_survival_total", "dspark_verified_positions_total", "position"),
         "observed pos {{position}}")], "percentunit"),
    Panel("Draft source mix: chosen drafts/s by source (suffix / hybrid drafters)", [
        (f"sum by (arm, source) (rate(dspark_draft_source_chosen_total{{{SEL}}}[{RATE}]))", "{{arm}} {{source}}")]),
    Panel("Acceptance rate by draft source", [
        (_ratio("dspark_draft_source_accepted_tokens_total", "dspark_draft_source_verified_tokens_total",
                "arm, source"), "{{arm}} {{source}}")], "percentunit"),
    Panel("Draft gate (1: drafting)", [
        (f"max by (arm, replica) (dspark_draft_gate_open{{{SEL}}})", "{{arm}} {{replica}}")]),
    Panel("Tokens through the target per step (B)", [
        (_ratio("dspark_step_tokens_sum", "dspark_step_tokens_count"), "mean {{arm}}")]),
])

LATENCY = Board("dspark-latency", "dspark: latency", [
    Panel("Time to first token", [(_q(0.5, "vllm:time_to_first_token_seconds"), "p50 {{arm}}"),
                                  (_q(0.99, "vllm:time_to_first_token_seconds"), "p99 {{arm}}")], "s"),
    Panel("Inter-token latency (per delivery)", [(_q(0.5, "vllm:inter_token_latency_seconds"), "p50 {{arm}}"),
                                                 (_q(0.99, "vllm:inter_token_latency_seconds"), "p99 {{arm}}")], "s"),
    Panel("Time per output token (per request)", [
        (_q(0.5, "vllm:request_time_per_output_token_seconds"), "p50 {{arm}}"),
        (_q(0.99, "vllm:request_time_per_output_token_seconds"), "p99 {{arm}}")], "s"),
    Panel("End-to-end request latency", [(_q(0.5, "vllm:e2e_request_latency_seconds"), "p50 {{arm}}"),
                                         (_q(0.99, "vllm:e2e_request_latency_seconds"), "p99 {{arm}}")], "s"),
    Panel("Verify step time", [(_q(0.5, "dspark_step_seconds"), "p50 {{arm}}"),
                               (_q(0.99, "dspark_step_seconds"), "p99 {{arm}}")], "s"),
])

THROUGHPUT = Board("dspark-throughput", "dspark: throughput", [
    Panel("Generated tokens/s", [
        (f"sum by (arm) (rate(vllm:generation_tokens_total{{{SEL}}}[{RATE}]))", "{{arm}}")]),
    Panel("Prompt tokens/s", [(f"sum by (arm) (rate(vllm:prompt_tokens_total{{{SEL}}}[{RATE}]))", "{{arm}}")]),
    Panel("Finished requests/s by reason", [
        (f"sum by (arm, finished_reason) (rate(vllm:request_success_total{{{SEL}}}[{RATE}]))",
         "{{arm}} {{finished_reason}}")], "reqps"),
    Panel("Requests running / waiting", [
        (f"sum by (arm) (vllm:num_requests_running{{{SEL}}})", "running {{arm}}"),
        (f"sum by (arm) (vllm:num_requests_waiting{{{SEL}}})", "waiting {{arm}}")]),
    Panel("Error responses/s by status", [
        (f'sum by (status) (rate(dspark_request_errors_total{{model_name=~"$model_name"}}[{RATE}]))',
         "{{status}}")], "reqps"),
])

AB = Board("dspark-ab", "dspark: A/B arms side by side", [
    Panel("TTFT p50 by arm", [(_q(0.5, "vllm:time_to_first_token_seconds"), "{{arm}}")], "s"),
    Panel("Time per output token p50 by arm", [(_q(0.5, "vllm:request_time_per_output_token_seconds"), "{{arm}}")],
          "s"),
    Panel("Output tokens/s by arm", [
        (f"sum by (arm) (rate(vllm:generation_tokens_total{{{SEL}}}[{RATE}]))", "{{arm}}")]),
    Panel("Requests/s by arm", [(f"sum by (arm) (rate(vllm:request_success_total{{{SEL}}}[{RATE}]))", "{{arm}}")],
          "reqps"),
    Panel("τ by arm", [
        ("1 + " + _ratio("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"),
         "{{arm}}")]),
])

POOLS = Board("dspark-pools", "dspark: pools, transport, scheduler", [
    Panel("Replicas per pool", [(f"max by (arm, pool) (dspark_pool_replicas{{{SEL}}})", "{{arm}} {{pool}}")]),
    Panel("Draft replica utilisation", [
        (f"sum by (arm, replica) (rate(dspark_draft_busy_seconds_total{{{SEL}}}[{RATE}]))", "{{arm}} {{replica}}")],
        "percentunit"),
    Panel("Draft contexts held", [(f"sum by (arm, replica) (dspark_draft_contexts{{{SEL}}})", "{{arm}} {{replica}}")]),
    Panel("Verify side's wait for drafts", [(_q(0.5, "dspark_draft_wait_seconds"), "p50 {{arm}}"),
                                            (_q(0.99, "dspark_draft_wait_seconds"), "p99 {{arm}}")], "s"),
    Panel("Transport time per round", [(_q(0.5, "dspark_transport_seconds"), "p50 {{arm}}"),
                                       (_q(0.99, "dspark_transport_seconds"), "p99 {{arm}}")], "s"),
    Panel("Scheduler decision latency", [(_q(0.99, "dspark_scheduler_decision_seconds", "decision"),
                                          "p99 {{decision}}")], "s"),
    Panel("Autoscaler: target replicas per pool", [
        ('max by (arm, target_pool) (dspark_autoscale_target_replicas{arm=~"$arm"})', "{{arm}} {{target_pool}}")]),
    Panel("Autoscaler decisions/s (up, down, hold)", [
        (f'sum by (arm, target_pool, direction) (rate(dspark_autoscale_decisions_total{{arm=~"$arm"}}[{RATE}]))',
         "{{arm}} {{target_pool}} {{direction}}")]),
])

BOARDS = [SPEC, LATENCY, THROUGHPUT, AB, POOLS]


def build(board: Board) -> g.Dashboard:
    panels = []
    for i, p in enumerate(board.panels):
        targets = [g.Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + j))
                   for j, (expr, legend) in enumerate(p.queries)]
        panels.append(g.TimeSeries(title=p.title, description=p.description, dataSource=DATASOURCE,
                                   targets=targets, unit=p.unit,
                                   gridPos=g.GridPos(h=8, w=12, x=12 * (i % 2), y=8 * (i // 2))))
    templating = g.Templating(list=[
        g.Template(name="datasource", query="prometheus", type="datasource", label="Prometheus"),
        g.Template(name="model_name", query="label_values(vllm:num_requests_running, model_name)",
                   dataSource=DATASOURCE, label="Model", includeAll=True, multi=True, allValue=".+"),
        g.Template(name="arm", query="label_values(vllm:num_requests_running, arm)", dataSource=DATASOURCE,
                   label="A/B arm", includeAll=True, multi=True, allValue=".+"),
    ])
    return g.Dashboard(title=board.title, uid=board.uid, panels=panels, templating=templating, refresh="10s",
                       tags=["dspark"], timezone="browser", schemaVersion=39).auto_panel_ids()


def dashboard_json(board: Board) -> dict:
    return json.loads(json.dumps(build(board).to_json_data(), cls=DashboardEncoder))


def write_dashboards(out_dir: Path) -> list[Path]:
    """configs/grafana/<uid>.json for each board, plus the file-provisioning YAML Grafana reads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for board in BOARDS:
        path = out_dir / f"{board.uid}.json"
        path.write_text(json.dumps(dashboard_json(board), indent=1, sort_keys=True) + "\n")
        paths.append(path)
    (out_dir / "provisioning.yaml").write_text(
        "# Grafana file provisioning: copy to /etc/grafana/provisioning/dashboards/dspark.yaml and point\n"
        "# `path` at this folder (generated by `dspark dashboard build`; do not edit the JSON by hand)\n"
        "apiVersion: 1\nproviders:\n  - name: dspark\n    folder: dspark\n    type: file\n"
        "    disableDeletion: false\n    allowUiUpdates: false\n    options:\n"
        "      path: /etc/dspark/grafana\n      foldersFromFilesStructure: false\n")
    return paths


def all_queries() -> list[tuple[str, str, str]]:
    """(board uid, panel title, PromQL) of every panel query, for the test that runs them."""
    return [(b.uid, p.title, expr) for b in BOARDS for p in b.panels for expr, _ in p.queries]


def push(url: str, token: str, folder: str = "dspark") -> list[str]:
    """Create or overwrite every dashboard on a Grafana server (grafana-client); returns their URLs."""
    from urllib.parse import urlparse

    from grafana_client import GrafanaApi

    parsed = urlparse(url)
    api = GrafanaApi(auth=token, host=parsed.hostname, port=parsed.port, protocol=parsed.scheme or "http",
                     url_path_prefix=parsed.path.strip("/"))
    existing = {f["title"]: f["uid"] for f in api.folder.get_all_folders()}
    folder_uid = existing.get(folder) or api.folder.create_folder(folder)["uid"]
    urls = []
    for board in BOARDS:
        result = api.dashboard.update_dashboard({"dashboard": dashboard_json(board), "folderUid": folder_uid,
                                                 "overwrite": True})
        urls.append(url.rstrip("/") + result.get("url", ""))
    return urls
