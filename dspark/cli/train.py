"""`dspark train | train-sanity | train-curve | eval | compare`: the drafter toolchain (training, its sanity
check and learning curve, offline evaluation, comparison)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dspark.cli.common import DEVICE, DTYPE, TARGET, THREADS, emit, setup


def train(
    config: Path = typer.Option(..., help="Pipeline YAML, e.g. configs/train/dspark_smollm2.yaml."),
    stages: str | None = typer.Option(None, help="Comma-separated subset of stages (default: all)."),
    num_threads: int | None = THREADS,
) -> None:
    """Run the drafter training pipeline; each stage is skipped when its output exists."""
    setup(num_threads, verbose=True)
    from dspark.training.pipeline import STAGES, run_pipeline
    from dspark.training.pipeline_config import PipelineConfig

    try:
        cfg = PipelineConfig.from_yaml(config)
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    chosen = tuple(s for s in stages.split(",") if s) if stages else STAGES
    unknown = set(chosen) - set(STAGES)
    if unknown:
        typer.echo(f"error: unknown stages {sorted(unknown)}; expected {list(STAGES)}", err=True)
        raise typer.Exit(2)
    typer.echo(json.dumps(run_pipeline(cfg, chosen), default=str))


def train_sanity(
    config: Path = typer.Option(..., help="Pipeline YAML whose model section is checked."),
    num_prompts: int = typer.Option(50, min=1, help="Training prompts to overfit."),
    num_steps: int = typer.Option(600, min=1),
    lr: float = typer.Option(1e-3, min=0.0),
    num_anchors: int = typer.Option(32, min=1, help="Blocks per sequence and step."),
    max_new_tokens: int = typer.Option(128, min=8, help="Greedy response length (training and decoding)."),
    fresh: bool = typer.Option(False, help="Discard an earlier sanity run of this config."),
    num_threads: int | None = THREADS,
) -> None:
    """Overfit check: train the drafter on a few prompts only, decode them at T=0, report τ (JSON last)."""
    setup(num_threads, verbose=True)
    from dspark.training.pipeline_config import PipelineConfig
    from dspark.training.sanity import run_sanity

    cfg = PipelineConfig.from_yaml(config)
    typer.echo(json.dumps(run_sanity(cfg, num_prompts, num_steps, max_new_tokens, lr, num_anchors, fresh)))


def train_curve(
    state: Path = typer.Option(..., help="A run's train_state.pt (e.g. ~/.cache/dspark/train/smollm2/runs/NAME/)."),
    window: int = typer.Option(50, min=1, help="Steps averaged per point."),
    plot: Path | None = typer.Option(None, help="PNG: τ estimate and loss vs steps, τ vs training tokens."),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
    after: Path | None = typer.Option(None, help="The curve JSON of the run this one continued from "
                                      "(model.init_checkpoint): steps and tokens count on from its end."),
    forecast_tau: list[float] = typer.Option([2.0, 2.5, 3.0], "--forecast-tau",
                                             help="τ values to forecast the tokens seen for (log-linear fit)."),
) -> None:
    """A training run's learning curve from its saved history (τ estimated from acceptance), and the tokens a
    target τ would take if the log-linear trend held; JSON last."""
    from dspark.training.curve import continue_curve, forecast, learning_curve, plot_curve

    curve = learning_curve(state.expanduser(), window)
    if after is not None:
        curve = continue_curve(curve, json.loads(after.read_text()))
    if len(curve["points"]) + len(curve.get("previous", [])) >= 4:
        curve["forecast"] = forecast(curve.get("previous", []) + curve["points"], tuple(forecast_tau))
    if plot:
        curve["plot"] = str(plot_curve(curve, plot))
    emit(curve, out)


def eval_cmd(
    drafter: str = typer.Option("dspark", help="Drafter name: dspark | dflash | eagle3 | mtp1 (or ngram, oracle)."),
    checkpoint: str | None = typer.Option(None, help="Drafter checkpoint folder (default: the shipped one)."),
    datasets: list[str] = typer.Option(["gsm8k", "humaneval", "mbpp", "mt-bench"], "--datasets",
                                       help="Shared eval set names or JSONL files of {'turns': [...]}"),
    temperature: list[float] = typer.Option([1.0, 0.0], "--temperature", help="Sampling temperatures."),
    num_prompts: int = typer.Option(10, min=1, help="Prompts per dataset."),
    max_new_tokens: int = typer.Option(128, min=1),
    block_size: int | None = typer.Option(None, min=1, help="γ: fixed verification block (no scheduler); default: "
                                          "the drafter's own block size (7 for ngram/oracle)."),
    label: str | None = typer.Option(None, help="Name of this run in the report, its files and `dspark compare` "
                                     "(default: the drafter name), e.g. dspark_g12 for an ablation."),
    out_dir: Path = typer.Option(Path("out/eval"), help="Where the PNG plots and JSON go."),
    target: str = TARGET, device: str = DEVICE, dtype: str | None = DTYPE, num_threads: int | None = THREADS,
) -> None:
    """Offline evaluation: τ per dataset, position-wise acceptance, calibration (JSON last, PNG plots)."""
    setup(num_threads)
    from dspark.bench.plots import plot_conditional_acceptance, plot_reliability
    from dspark.models.drafters.registry import make_drafter
    from dspark.models.target.loader import load_target
    from dspark.training.evaluate import evaluate

    tgt = load_target(target, device, dtype)
    kwargs = {"path": checkpoint} if checkpoint else {}
    try:
        d = make_drafter(drafter, tgt, **kwargs)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if block_size is None:
        block_size = int(getattr(d, "block_size", 7))
    name = label or drafter
    sts = None
    model = getattr(d, "model", None)
    if model is not None and getattr(model.config, "sts_temperatures", None):
        sts = list(model.config.sts_temperatures)
        model.config.sts_temperatures = None  # record raw confidences; "after" applies STS offline
    report = evaluate(tgt, d, datasets, temperature, num_prompts, max_new_tokens, block_size,
                      sts_temperatures=sts)
    rounds = report.pop("_rounds")
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = [str(plot_conditional_acceptance(report, out_dir / f"acceptance_{name}.png", name))]
    for temp, r in rounds.items():
        logits, survived, valid = r.calibration_arrays(block_size)
        if logits.shape[0]:
            report["plots"].append(str(plot_reliability(logits, survived, valid, sts,
                                                        out_dir / f"reliability_{name}_T{temp}.png")))
    summary = {"drafter": name, "kind": drafter, "checkpoint": checkpoint, "sts_temperatures": sts, **report}
    for temp, run in report["runs"].items():
        cal = run["calibration"]
        summary[f"T={temp}"] = {"tau": run["tau"], "tau_macro": run["tau_macro"],
                                "conditional_acceptance": run["conditional_acceptance"],
                                "ece_before": cal.get("ece_before_mean"), "ece_after": cal.get("ece_after_mean"),
                                "auc": cal.get("auc_after", cal.get("auc_before")), "sources": run.get("sources"),
                                "ece_by_source": {s: c.get("ece_before_mean") for s, c in
                                                  run.get("calibration_by_source", {}).items()} or None,
                                # a perfectly calibrated survival's ECE on the same rounds (sampling noise)
                                "ece_noise_floor_by_source": {s: c.get("ece_before_noise_floor_mean") for s, c in
                                                              run.get("calibration_by_source", {}).items()} or None,
                                "bias_by_source": {s: c.get("bias_before") for s, c in
                                                   run.get("calibration_by_source", {}).items()} or None}
    emit(summary, out_dir / f"eval_{name}.json")


def compare_cmd(
    reports: list[Path] = typer.Argument(..., help="`dspark eval` JSON files, one per drafter."),
    out: Path = typer.Option(Path("out/compare.png"), help="PNG: acceptance by position, a panel per domain."),
    temperature: str = typer.Option("1.0", help="Which temperature's runs to draw."),
    gamma_sweep: bool = typer.Option(False, "--gamma-sweep", help="The reports are one drafter kind per block size "
                                     "γ: also give τ against γ and DSpark/DFlash per γ (Fig. 4, <out>_gamma.png)."),
) -> None:
    """Drafters side by side from their `dspark eval` reports: τ table (JSON) and the Fig. 2 plot."""
    from dspark.bench.gamma_sweep import gamma_sweep as sweep_of
    from dspark.bench.plots import plot_acceptance_by_domain, plot_gamma_sweep

    loaded: dict[str, dict] = {}
    for path in reports:
        try:
            report = json.loads(path.read_text())
            loaded[str(report["drafter"])] = report
        except (OSError, ValueError, KeyError) as exc:
            typer.echo(f"error: {path} is not a `dspark eval` report: {exc}", err=True)
            raise typer.Exit(2) from exc
    table = {name: {temp: {"tau_macro": run["tau_macro"], "tau": run["tau"], "tau_by_domain": run["tau_by_domain"]}
                    for temp, run in report["runs"].items()} for name, report in loaded.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"tau": table, "plot": str(plot_acceptance_by_domain(loaded, out, temperature))}
    if gamma_sweep:
        try:
            sweep = sweep_of(loaded, temperature)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        gamma_png = out.with_name(f"{out.stem}_gamma.png")
        result["gamma_sweep"] = {**sweep, "plot": str(plot_gamma_sweep(sweep, gamma_png, temperature))}
    emit(result, None)
