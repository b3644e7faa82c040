"""`dspark autoscale | ab | dashboard ...`: operating a cluster (its autoscaling policy, A/B reports, Grafana)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dspark.cli.common import emit

autoscale_app = typer.Typer(no_args_is_help=True, help="The pools' autoscaling policy.")
ab_app = typer.Typer(no_args_is_help=True, help="A/B tests between serving arms.")
dashboard_app = typer.Typer(no_args_is_help=True, help="Grafana dashboards (generated from code).")


@autoscale_app.command("simulate")
def autoscale_simulate_cmd(
    traces: str = typer.Option("rising,bursty,falling", help="Comma-separated traces (dspark.autoscale.simulate)."),
    sps_profile: Path = typer.Option(
        Path("configs/profiles/cpu-amx-intel-r-xeon-r-processor-smollm2-135m-instruct-bfloat16-2t.json"),
        help="SPS profile whose step times the simulated verify replicas run at."),
    ttft_sla_s: float = typer.Option(1.0, help="TTFT p50 SLA."),
    tpot_sla_s: float = typer.Option(0.05, help="Time-per-output-token p50 SLA."),
    max_replicas: int = typer.Option(4, min=1, help="Per pool."),
    downscale_delay_s: float = typer.Option(60.0, min=0),
    stale: str = typer.Option("", help="FROM-TO seconds with no metrics (e.g. 250-280), to see the hold."),
    plot: Path | None = typer.Option(None, help="PNG: load, replicas per pool and TTFT vs SLA per trace."),
    out: Path | None = typer.Option(None),
) -> None:
    """Replay traffic traces through the real autoscaling policy, without a cluster; JSON last."""
    from dspark.autoscale.policy import SLA, PolicyConfig, PoolLimits, knee_of
    from dspark.autoscale.simulate import TRACES, SimConfig, simulate
    from dspark.bench.plots import plot_autoscale
    from dspark.spec.sps import SPSTable

    names = [t for t in traces.split(",") if t]
    unknown = [t for t in names if t not in TRACES]
    if unknown or not sps_profile.exists():
        typer.echo(f"error: unknown traces {unknown} (known: {list(TRACES)})" if unknown
                   else f"error: {sps_profile} not found", err=True)
        raise typer.Exit(2)
    sps = SPSTable.from_file(sps_profile).monotone()
    cfg = PolicyConfig(sla=SLA(ttft_p50_s=ttft_sla_s, tpot_p50_s=tpot_sla_s), knee_tokens=knee_of(sps),
                       verify=PoolLimits(1, max_replicas), draft=PoolLimits(1, max_replicas),
                       downscale_delay_s=downscale_delay_s)
    windows = [tuple(float(x) for x in stale.split("-"))] if stale else []
    results = {n: simulate(TRACES[n], sps, cfg, SimConfig(stale_windows=windows)) for n in names}  # type: ignore[arg-type]
    summary = {n: {k: v for k, v in r.items() if k != "timeline"} for n, r in results.items()}
    if plot:
        summary["plot"] = str(plot_autoscale(results, ttft_sla_s, plot))
    emit({"knee_tokens": cfg.knee_tokens, "traces": summary}, out)


@ab_app.command("report")
def ab_report_cmd(
    log: Path = typer.Option(..., help="The ingress's request log (serve config `request_log`), JSONL."),
    alpha: float = typer.Option(0.05, min=0.001, max=0.5, help="Two-sided significance level of the intervals."),
    min_effect: float = typer.Option(0.05, min=0.0, help="Smallest relative TPS/user difference worth seeing."),
    num_resamples: int = typer.Option(1000, min=100, help="Bootstrap resamples."),
    out: Path | None = typer.Option(None),
) -> None:
    """Per-arm TPS/user, TTFT p50/p99, throughput, τ, verification length, error rate, with bootstrap
    intervals of each difference against the first arm; which arm wins; whether the sample suffices."""
    from dspark.bench.ab_report import ab_report, load_log

    try:
        res = ab_report(load_log(log), alpha=alpha, num_resamples=num_resamples, min_effect=min_effect)
    except (OSError, ValueError, KeyError) as exc:
        typer.echo(f"error: {exc!r}", err=True)
        raise typer.Exit(2) from exc
    emit(res, out)


@dashboard_app.command("build")
def dashboard_build(out_dir: Path = typer.Option(Path("configs/grafana"), help="Where the JSON and the "
                                                 "file-provisioning YAML go.")) -> None:
    """Write every dashboard's JSON (and Grafana's provisioning YAML); JSON list of files last."""
    from dspark.metrics.dashboards import all_queries, write_dashboards

    paths = write_dashboards(out_dir)
    typer.echo(json.dumps({"dashboards": [str(p) for p in paths], "num_queries": len(all_queries())}))


@dashboard_app.command("push")
def dashboard_push(url: str = typer.Option(..., help="Grafana base URL, e.g. http://grafana:3000"),
                   token: str = typer.Option(..., envvar="GRAFANA_TOKEN", help="Service-account token "
                                             "(or GRAFANA_TOKEN in the environment)."),
                   folder: str = typer.Option("dspark", help="Grafana folder to put them in.")) -> None:
    """Create or overwrite the dashboards on a Grafana server through its HTTP API (grafana-client)."""
    from dspark.metrics.dashboards import push

    try:
        urls = push(url, token, folder)
    except Exception as exc:  # noqa: BLE001 - a CLI: say what failed, no traceback
        typer.echo(f"error: pushing to {url} failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(json.dumps({"pushed": urls}))
