"""The `dspark` command line: generate, profile, bench."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch
import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="DSpark speculative decoding.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (print JSON as the last line).")
app.add_typer(bench_app, name="bench")
autoscale_app = typer.Typer(no_args_is_help=True, help="The pools' autoscaling policy.")
app.add_typer(autoscale_app, name="autoscale")
ab_app = typer.Typer(no_args_is_help=True, help="A/B tests between serving arms.")
app.add_typer(ab_app, name="ab")
dashboard_app = typer.Typer(no_args_is_help=True, help="Grafana dashboards (generated from code).")
app.add_typer(dashboard_app, name="dashboard")
from dspark.cli_suffix import suffix_app  # noqa: E402  (the suffix proposer's commands)

app.add_typer(suffix_app, name="suffix")

TARGET = typer.Option("smollm2-135m-instruct", help="HF causal-LM folder or the embedded default.")
DEVICE = typer.Option("cpu", help="cpu or cuda[:N].")
DTYPE = typer.Option(None, help="fp32 | bf16 | fp16 (default: fp32 on CPU, bf16 on GPU).")
THREADS = typer.Option(None, help="torch threads (default: torch's choice).")


def _hf_dtypes(spec: str, device: str) -> list[str]:
    """`auto`: the dtypes with a fast path on this machine (bf16 is emulated and slow without bf16 units)."""
    from dspark.models.dtype_choice import candidate_dtypes

    return candidate_dtypes(device) if spec.strip() == "auto" else [d for d in spec.split(",") if d]


def _setup(num_threads: int | None, verbose: bool = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if num_threads:
        torch.set_num_threads(num_threads)


@app.command()
def generate(
    prompt: str = typer.Option(..., help="User message (chat template applied unless --raw)."),
    drafter: str = typer.Option("ngram", help="none | ngram | oracle | dspark | dflash | eagle3 | mtp1 (trained "
                                "drafters load checkpoints/<name>-smollm2)."),
    scheduler: str = typer.Option("greedy", help="fixed | threshold | greedy | async"),
    temperature: float = typer.Option(0.0, min=0.0),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    seed: int | None = typer.Option(None),
    max_tokens: int = typer.Option(128, min=1),
    num_draft_tokens: int = typer.Option(7, min=0, help="γ: draft block size."),
    raw: bool = typer.Option(False, help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with per-step stats."),
    target: str = TARGET, device: str = DEVICE, dtype: str | None = DTYPE,
    sps_profile: str | None = typer.Option(None, help="SPS profile JSON (default configs/profiles/<device>.json)."),
    num_threads: int | None = THREADS,
) -> None:
    """Generate one completion with speculative decoding."""
    _setup(num_threads)
    from dspark.bench.prompts import chat_prompt_ids
    from dspark.verify_service.engine import Engine, EngineConfig
    from dspark.verify_service.request import SamplingParams

    cfg = EngineConfig(target=target, device=device, dtype=dtype, drafter=drafter, scheduler=scheduler,
                       num_draft_tokens=num_draft_tokens, sps_profile=sps_profile, max_num_seqs=1,
                       scheduler_kwargs={"k": num_draft_tokens} if scheduler == "fixed" else {})
    try:
        engine = Engine(cfg)
        ids = chat_prompt_ids(engine.tokenizer, prompt, raw=raw)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        t0 = time.perf_counter()
        (req,) = engine.generate([ids], params)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    wall_s = time.perf_counter() - t0
    text = engine.tokenizer.decode(req.output_ids, skip_special_tokens=True)
    if req.stop_text_len is not None:
        text = text[:req.stop_text_len]
    if not as_json:
        typer.echo(text)
        return
    steps = [{"num_tokens": s.num_tokens, "verify_len": s.lengths[0], "num_accepted": s.num_accepted[0],
              "draft_ms": round(s.draft_ms, 2), "verify_ms": round(s.verify_ms, 2)} for s in engine.stats]
    typer.echo(json.dumps({
        "text": text, "token_ids": req.output_ids, "finish_reason": str(req.finish_reason.value),
        "num_prompt_tokens": len(ids), "num_steps": req.num_steps,
        "tau": (req.num_accepted + req.num_steps) / max(req.num_steps, 1),
        "tok_s": len(req.output_ids) / wall_s, "steps": steps}))


@app.command()
def profile(
    out_dir: Path = typer.Option(Path("configs/profiles"), help="Where the profiles go (one per dtype)."),
    target: str = TARGET, device: str = DEVICE,
    dtypes: str = typer.Option("auto", help="Comma-separated dtypes to profile; auto: every candidate this "
                               "machine has (fp32, and bf16 where it has bf16 units or is a GPU)."),
    max_tokens_per_step: int = typer.Option(256, min=1),
    context_len: int = typer.Option(256, min=1),
    num_repeats: int = typer.Option(5, min=1),
    num_threads: int | None = THREADS,
) -> None:
    """Measure the fastest dtype per role and, per dtype, target step time vs tokens per step (SPS)."""
    _setup(num_threads)
    from dspark.bench.profile import DEFAULT_GRID, profile_target
    from dspark.models.dtype_choice import candidate_dtypes, measure_dtypes
    from dspark.models.target import load_target
    from dspark.verify_service.profiles import slug

    grid = tuple(b for b in DEFAULT_GRID if b <= max_tokens_per_step)
    chosen = candidate_dtypes(device) if dtypes == "auto" else [d for d in dtypes.split(",") if d]
    choice = measure_dtypes(target, device)
    results = []
    for dtype in chosen:
        table = profile_target(load_target(target, device, dtype), grid, context_len, num_repeats=num_repeats)
        table.meta["dtypes"] = choice
        path = out_dir / f"{slug(table.meta)}.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        table.save(path)
        results.append({"out": str(path), "dtype": dtype, **table.to_dict(),
                        "sps": [round(table.sps(b), 3) for b in table.tokens_per_step]})
    typer.echo(json.dumps({"dtype_choice": choice, "profiles": results}))


@app.command()
def train(
    config: Path = typer.Option(..., help="Pipeline YAML, e.g. configs/train/dspark_smollm2.yaml."),
    stages: str | None = typer.Option(None, help="Comma-separated subset of stages (default: all)."),
    num_threads: int | None = THREADS,
) -> None:
    """Run the drafter training pipeline; each stage is skipped when its output exists."""
    _setup(num_threads, verbose=True)
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


@app.command("train-sanity")
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
    _setup(num_threads, verbose=True)
    from dspark.training.pipeline_config import PipelineConfig
    from dspark.training.sanity import run_sanity

    cfg = PipelineConfig.from_yaml(config)
    typer.echo(json.dumps(run_sanity(cfg, num_prompts, num_steps, max_new_tokens, lr, num_anchors, fresh)))


@app.command("train-curve")
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
    _emit(curve, out)


@app.command("eval")
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
    _setup(num_threads)
    from dspark.bench.plots import plot_conditional_acceptance, plot_reliability
    from dspark.models.drafter import make_drafter
    from dspark.models.target import load_target
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
                                                  run.get("calibration_by_source", {}).items()} or None}
    _emit(summary, out_dir / f"eval_{name}.json")


@app.command("compare")
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
    _emit(result, None)


@bench_app.command("decode")
def bench_decode_cmd(
    drafters: str = typer.Option("ngram,oracle", help="Comma-separated drafter names (none, ngram, oracle, dspark, "
                                 "dflash, eagle3, mtp1; trained ones load checkpoints/<name>-smollm2); "
                                 "dspark-nosts: the same DSpark checkpoint without its STS temperatures."),
    batch_sizes: str = typer.Option("1,8"),
    num_prompts: int = typer.Option(4, min=1, help="Prompts decoded one by one at batch 1."),
    max_new_tokens: int = typer.Option(128, min=1),
    scheduler: str = typer.Option("fixed", help="Scheduler for the non-oracle drafters."),
    num_draft_tokens: int = typer.Option(7, min=1),
    hf_dtypes: str = typer.Option("auto", help="Dtypes for the HF generate reference ('' to skip; auto: fp32, "
                                  "and bf16 where the CPU has bf16 units)."),
    sps_profile: str | None = typer.Option(None),
    draft_gate: bool = typer.Option(True, help="Skip drafting where it has not paid (load-aware schedulers); "
                                    "--no-draft-gate lets the scheduler alone pick every length."),
    checkpoint: list[str] = typer.Option([], "--checkpoint", help="NAME=FOLDER: load drafter NAME from FOLDER "
                                         "instead of checkpoints/<name>-smollm2 (repeatable)."),
    target: str = TARGET, device: str = DEVICE, dtype: str | None = DTYPE,
    num_threads: int | None = THREADS,
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """HF generate vs target-only engine vs speculative decoding (greedy, fixed seed)."""
    _setup(num_threads)
    from dspark.bench.decode import bench_decode
    from dspark.models.target import load_target

    checkpoints = {}
    for item in checkpoint:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            typer.echo(f"error: --checkpoint expects NAME=FOLDER, got {item!r}", err=True)
            raise typer.Exit(2)
        checkpoints[name] = folder
    try:
        res = bench_decode(load_target(target, device, dtype), [d for d in drafters.split(",") if d],
                           [int(b) for b in batch_sizes.split(",")], num_prompts, max_new_tokens, scheduler,
                           num_draft_tokens, sps_profile, _hf_dtypes(hf_dtypes, device), checkpoints,
                           draft_gate)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    _emit(res, out)


@bench_app.command("batching")
def bench_batching_cmd(target: str = TARGET, device: str = DEVICE, dtype: str | None = DTYPE,
                       num_threads: int | None = THREADS, out: Path | None = typer.Option(None)) -> None:
    """Verify step time: mixed verification lengths vs uniform, same total tokens."""
    _setup(num_threads)
    from dspark.bench.batching import bench_batching
    from dspark.models.target import load_target

    _emit(bench_batching(load_target(target, device, dtype)), out)


@bench_app.command("chaos")
def bench_chaos_cmd(
    config: Path = typer.Option(Path("configs/serve.yaml"), help="Serve config whose first application's args "
                                "are the base (A/B arms dropped: one cluster of 2 verify + 2 draft workers)."),
    scenarios: str = typer.Option("draft,verify,scheduler,draft+verify", help="Faults, one at a time."),
    num_requests: int = typer.Option(8, min=1), max_tokens: int = typer.Option(64, min=1),
    kill_after_s: float = typer.Option(2.0, min=0.0, help="Seconds into the load at which the SIGKILL lands."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE override of the application's args."),
    front_door: str = typer.Option("auto", help="What accepts connections: haproxy (Serve direct ingress behind "
                                   "HAProxy), proxy (Serve's ProxyActor) or auto (haproxy when installed)."),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """kill -9 workers under bounded load: requests lost, outputs changed, time to recover, leaks; JSON last."""
    import yaml

    from dspark.bench.chaos import run_chaos
    from dspark.bench.overload import load_serve_args
    from dspark.bench.prompts import load_turns

    try:
        args = load_serve_args(config)
        args.pop("ab_arms", None)
        args.pop("request_log", None)
        for item in set_:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
            args[key.strip()] = yaml.safe_load(value)
        prompts = [t for t in load_turns("gsm8k", num_requests)][:num_requests]
        with _front_door(front_door) as door:
            res = {**run_chaos(args, prompts, max_tokens, [s for s in scenarios.split(",") if s], kill_after_s),
                   "front_door": door}
    except (OSError, ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    _emit(res, out)


def _front_door(kind: str) -> contextlib.AbstractContextManager[str]:
    """The front door of the cluster this command starts, for the command's duration (the environment is
    restored after it: commands run in-process, e.g. from tests, leave no switch behind)."""
    from dspark.cluster.front_door import front_door_environment

    if kind not in ("auto", "haproxy", "proxy"):
        raise ValueError(f"--front-door must be auto, haproxy or proxy, got {kind!r}")
    return front_door_environment(kind)  # type: ignore[arg-type]


@bench_app.command("overload")
def bench_overload_cmd(
    config: Path = typer.Option(Path("configs/serve.yaml"), help="Serve config whose first application is run."),
    multiple: float = typer.Option(10.0, min=1.0, help="Requests sent (and their arrival rate), in multiples of the "
                                   "admission limit (and of the measured completion rate)."),
    burst: bool = typer.Option(True, help="Also send the same count in one instant."),
    repeat: int = typer.Option(1, min=1, help="Sustained phases in a row per admission mode (memory that levels "
                                              "off is bounded)."),
    modes: str = typer.Option("static,sla", help="Admission modes to run one after the other on the same "
                                                 "cluster: static (the fixed limit), sla (predicted latency)."),
    max_tokens: int = typer.Option(16, min=1),
    rss_bound_mb: float | None = typer.Option(None, help="Stated memory bound for all Ray processes (MiB); "
                                              "default: their peak at full load (the calibrate phase: the "
                                              "admission limit in flight) + --rss-margin-mb."),
    rss_margin_mb: float = typer.Option(512.0, min=0.0, help="What the overload phases may take over full load."),
    front_door: str = typer.Option("auto", help="What accepts connections: haproxy (Serve direct ingress behind "
                                   "HAProxy), proxy (Serve's ProxyActor) or auto (haproxy when installed)."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE override of the application's args."),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Overload: N x the limit at N x the capacity, then at once; 429 + Retry-After latency, memory."""
    import yaml

    from dspark.bench.overload import load_serve_args, run_overload

    try:
        args = load_serve_args(config)
        for item in set_:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
            args[key.strip()] = yaml.safe_load(value)
        with _front_door(front_door) as door:
            res = {**run_overload(args, multiple, max_tokens, rss_bound_mb, rss_margin_mb, burst=burst,
                                  repeat=repeat, modes=tuple(m.strip() for m in modes.split(",") if m.strip())),
                   "front_door": door}
    except (OSError, ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    _emit(res, out)


@bench_app.command("serve")
def bench_serve_cmd(
    arms: str = typer.Option("no-spec,fixed-k,scheduled", help="Comma-separated arms to run, in order. Built in: "
                             "no-spec (drafter none), mtp1 (MTP-1, one draft token every step), fixed-k "
                             "(--drafter, fixed k=γ), scheduled (--drafter, "
                             "greedy = Algorithm 1), colocated / decoupled (scheduled in that mode). '' for none."),
    arm_config: Path | None = typer.Option(None, help="YAML mapping arm name -> ServeAppConfig overrides; its "
                                           "arms run after --arms (a built-in name is replaced)."),
    target: str = TARGET, device: str = DEVICE,
    drafter: str = typer.Option("dspark", help="Drafter of the speculative built-in arms."),
    num_draft_tokens: int = typer.Option(7, min=1, help="γ of the speculative built-in arms."),
    concurrency: str = typer.Option("1,2,4,8,16,32", help="Concurrency levels (requests in flight)."),
    num_requests: int | None = typer.Option(None, min=1, help="Requests per level (default max(2C, 8); at least C)."),
    max_tokens: int = typer.Option(64, min=1, help="Output tokens per request (EOS ignored)."),
    temperature: float = typer.Option(0.0, min=0.0),
    seed: int = typer.Option(0, help="Request i sends seed + i."),
    num_warmup: int = typer.Option(2, min=0, help="Uncounted warm-up requests before each level."),
    max_num_seqs: int | None = typer.Option(None, min=1, help="Server batch cap (default: highest level)."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE ServeAppConfig override for every arm "
                                   "(YAML value, e.g. --set num_cpus_per_replica=2); arm values win."),
    peer_url: str | None = typer.Option(None, help="Running OpenAI-compatible server (e.g. vLLM) to load "
                                        "as the extra arm 'peer', e.g. http://host:8000."),
    peer_model: str | None = typer.Option(None, help="`model` sent to --peer-url."),
    timeout_s: float = typer.Option(600.0, min=1.0, help="Per-request timeout."),
    keep_requests: bool = typer.Option(False, help="Keep per-request records in the JSON."),
    interleave: bool = typer.Option(False, help="Start all arms at once (route /<arm>) and run each level in "
                                    "two passes of half the requests, arms in order then reversed, so slow "
                                    "drift of a shared machine hits every arm alike."),
    alone: bool = typer.Option(False, help="With --interleave: also measure each arm with only itself deployed, "
                               "and report alone vs interleaved per level (summary.fairness)."),
    peer_pid: int | None = typer.Option(None, help="pid of the --peer-url server: paused (SIGSTOP) while our arms "
                                        "run, so its idle threads cannot spin on our cores; its idle cost is "
                                        "measured first."),
    front_door: str = typer.Option("auto", help="What accepts connections: haproxy (Serve direct ingress behind "
                                   "HAProxy), proxy (Serve's ProxyActor) or auto (haproxy when installed)."),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
    plot_dir: Path | None = typer.Option(None, help="Write throughput-vs-TPS/user and verify-length PNGs here."),
) -> None:
    """OpenAI HTTP load (streamed, closed loop) against Ray Serve arms, swept over concurrency; JSON last."""
    import yaml

    from dspark.bench.load import LoadConfig
    from dspark.bench.plots import plot_serve_throughput_vs_tps_user, plot_serve_verify_len, plot_worker_timeline
    from dspark.bench.serve_bench import ServeBenchConfig, builtin_arms, load_arm_config, run_serve_bench

    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1:
            raise ValueError(f"--concurrency needs positive integers, got {concurrency!r}")
        known = builtin_arms(drafter, num_draft_tokens)
        chosen = [a.strip() for a in arms.split(",") if a.strip()]
        unknown = [a for a in chosen if a not in known]
        if unknown:
            raise ValueError(f"unknown arms {unknown}; built in: {list(known)} (custom ones: --arm-config)")
        arm_map = {a: known[a] for a in chosen}
        if arm_config:
            arm_map.update(load_arm_config(arm_config))
        if not arm_map and not peer_url:
            raise ValueError("nothing to run: no arms and no --peer-url")
        base: dict = {"target": target, "device": device, "max_num_seqs": max_num_seqs or max(levels)}
        if device.startswith("cuda"):
            base["num_gpus_per_replica"] = 1
        for item in set_:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
            base[key.strip()] = yaml.safe_load(value)
        load = LoadConfig(base_url="", max_tokens=max_tokens, temperature=temperature, seed=seed,
                          num_requests=num_requests, num_warmup=num_warmup, timeout_s=timeout_s)
        cfg = ServeBenchConfig(arms=arm_map, base=base, concurrency=levels, load=load, peer_url=peer_url,
                               peer_model=peer_model, keep_requests=keep_requests, interleave=interleave,
                               alone=alone, peer_pid=peer_pid)
        with _front_door(front_door) as door:
            res = {**run_serve_bench(cfg), "front_door": door}
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if out:  # the measurements are on disk before anything else can fail
        _emit(res, out, echo=False)
    if plot_dir:
        plot_dir.mkdir(parents=True, exist_ok=True)
        res["plots"] = [str(plot_serve_throughput_vs_tps_user(res, plot_dir / "serve_throughput_vs_tps_user.png")),
                        str(plot_serve_verify_len(res, plot_dir / "serve_verify_len.png"))]
        for arm, body in res["arms"].items():  # the last level's per-step spans of both pools
            stats = (body.get("levels") or [{}])[-1].get("server_stats")
            if stats and (png := plot_worker_timeline(stats, plot_dir / f"serve_timeline_{arm}.png")):
                res["plots"].append(str(png))
    _emit(res, out)


@bench_app.command("roofline")
def bench_roofline_cmd(
    target: str = TARGET, device: str = DEVICE,
    dtypes: str = typer.Option("", help="Comma-separated dtypes to measure (default: fp32, and bf16 where the "
                               "CPU has bf16 units: AVX-512 BF16 or AMX; elsewhere bf16 is emulated and slow)."),
    batch_sizes: str = typer.Option("1,8,32,128,256", help="Decode batch sizes."),
    context_len: int = typer.Option(128, min=1, help="Cached tokens per sequence while decoding."),
    row_invariant: bool = typer.Option(False, help="Decode with the verify engine's row-invariant kernels "
                                       "instead of the generation path's."),
    num_threads: int | None = THREADS,
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
    plot: Path | None = typer.Option(None, help="PNG of achieved vs roofline by batch size."),
) -> None:
    """GEMM roofline, bandwidth and dispatch cost at the target's shapes, and decode against them; JSON last."""
    _setup(num_threads)
    from dspark.bench.plots import plot_roofline
    from dspark.bench.roofline import run_roofline

    res = run_roofline(target, [d for d in dtypes.split(",") if d], device,
                       tuple(int(b) for b in batch_sizes.split(",") if b), context_len, row_invariant)
    if plot:
        res["plot"] = str(plot_roofline(res, plot))
    _emit(res, out)


@bench_app.command("generate")
def bench_generate_cmd(
    target: str = TARGET,
    num_prompts_before: int = typer.Option(64, min=1, help="Prompts through the old synth path (32 at once)."),
    num_prompts_after: int = typer.Option(512, min=1, help="Prompts through the generation path (256 at once)."),
    max_tokens: int = typer.Option(128, min=1, help="New tokens per prompt (EOS ignored)."),
    num_threads: int | None = THREADS,
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Offline generation throughput: the old synth path vs the generation path, one run; JSON last."""
    _setup(num_threads)
    from dspark.bench.generate import run_generate_bench

    _emit(run_generate_bench(target, num_prompts_before, num_prompts_after, max_tokens), out)


@bench_app.command("transport")
def bench_transport_cmd(
    rows: str = typer.Option("16,128,512", help="Feature rows per message (tokens that entered the KV cache)."),
    num_features: int = typer.Option(3 * 576, min=1, help="Columns per row: taps × hidden (SmolLM2: 3 × 576)."),
    reps: int = typer.Option(30, min=1, help="Round trips per size (after 2 warm-up)."),
    out: Path | None = typer.Option(None),
) -> None:
    """Draft<->verify transports between two Ray actors: gloo point-to-point vs Ray object refs."""
    import ray

    from dspark.actors.transport_probe import measure_transports

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        res = measure_transports([int(r) for r in rows.split(",") if r], num_features, reps)
    finally:
        ray.shutdown()
    _emit(res, out)


@autoscale_app.command("simulate")
def autoscale_simulate_cmd(
    traces: str = typer.Option("rising,bursty,falling", help="Comma-separated traces (dspark.autoscale.simulate)."),
    sps_profile: Path = typer.Option(
        Path("configs/profiles/cpu-amx-intel-r-xeon-r-processor-smollm2-135m-instruct-bfloat16.json"),
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
    _emit({"knee_tokens": cfg.knee_tokens, "traces": summary}, out)


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
    _emit(res, out)


@dashboard_app.command("build")
def dashboard_build(out_dir: Path = typer.Option(Path("configs/grafana"), help="Where the JSON and the "
                                                 "file-provisioning YAML go.")) -> None:
    """Write every dashboard's JSON (and Grafana's provisioning YAML); JSON list of files last."""
    from dspark.cluster.dashboards import all_queries, write_dashboards

    paths = write_dashboards(out_dir)
    typer.echo(json.dumps({"dashboards": [str(p) for p in paths], "num_queries": len(all_queries())}))


@dashboard_app.command("push")
def dashboard_push(url: str = typer.Option(..., help="Grafana base URL, e.g. http://grafana:3000"),
                   token: str = typer.Option(..., envvar="GRAFANA_TOKEN", help="Service-account token "
                                             "(or GRAFANA_TOKEN in the environment)."),
                   folder: str = typer.Option("dspark", help="Grafana folder to put them in.")) -> None:
    """Create or overwrite the dashboards on a Grafana server through its HTTP API (grafana-client)."""
    from dspark.cluster.dashboards import push

    try:
        urls = push(url, token, folder)
    except Exception as exc:  # noqa: BLE001 - a CLI: say what failed, no traceback
        typer.echo(f"error: pushing to {url} failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(json.dumps({"pushed": urls}))


# ---- prepare: the first start's work, before the cluster starts (issue 27) ---------------------------
@app.command()
def prepare(config: Path = typer.Option(Path("configs/serve.yaml"), help="The Serve config whose arms to "
                                        "prepare (target, dtype, drafter of each)."),
            verbose: bool = typer.Option(False, help="Log each step's details.")) -> None:
    """Convert the target, build the native kernels, measure the dtype, GEMM plans and SPS profile of every
    arm of a serve config, once per machine, into the cache (`make serve` runs it before `serve run`)."""
    from dspark.cluster.prepare import prepare as run_prepare
    from dspark.models.cache_once import PrepareError

    _setup(None, verbose)
    try:
        res = run_prepare(config)
    except (PrepareError, OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(json.dumps(res))


def _emit(res: dict, out: Path | None, echo: bool = True) -> None:
    line = json.dumps(res)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    if echo:
        typer.echo(line)


if __name__ == "__main__":
    app()
