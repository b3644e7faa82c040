"""`dspark bench ...`: the benchmarks (each prints JSON as its last line)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from dspark.cli.common import DEVICE, DTYPE, TARGET, THREADS, emit, setup


def _hf_dtypes(spec: str, device: str) -> list[str]:
    """`auto`: the dtypes with a fast path on this machine (bf16 is emulated and slow without bf16 units)."""
    from dspark.models.target.dtype_choice import candidate_dtypes

    return candidate_dtypes(device) if spec.strip() == "auto" else [d for d in spec.split(",") if d]


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (print JSON as the last line).")


@bench_app.command("decode")
def bench_decode_cmd(
    drafters: str = typer.Option("ngram,oracle", help="Comma-separated drafter names (none, ngram, oracle, dspark, "
                                 "dflash, eagle3, mtp1; trained ones load checkpoints/<name>-smollm2); "
                                 "dspark-nosts: the same DSpark checkpoint without its STS temperatures."),
    batch_sizes: str = typer.Option("1,8"),
    num_prompts: int = typer.Option(4, min=1, help="Prompts decoded one by one at batch 1, every arm in turn on "
                                    "each (target-only among them, the order rotated prompt by prompt)."),
    rounds: int = typer.Option(1, min=1, help="At batch 1: times over the prompts (each arm's time per prompt is "
                               "its mean); at batch > 1 with --waves > 1: whole runs per arm, the arms in turn "
                               "(pooled, with the per-round ratios); for ratios on a noisy host."),
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
    waves: int = typer.Option(4, min=1, help="At batch B > 1: WAVES x B prompts through B slots, each finished "
                              "request's slot refilled at the next step (continuous batching); 1: one closed "
                              "batch of B, which ends with its slowest request."),
    target: str = TARGET, device: str = DEVICE, dtype: str | None = DTYPE,
    num_threads: int | None = THREADS,
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """HF generate vs target-only engine vs speculative decoding (greedy, fixed seed)."""
    setup(num_threads)
    from dspark.bench.decode import bench_decode
    from dspark.models.target.loader import load_target

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
                           draft_gate, waves, rounds)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    emit(res, out)


@bench_app.command("batching")
def bench_batching_cmd(target: str = TARGET, device: str = DEVICE, dtype: str | None = DTYPE,
                       num_threads: int | None = THREADS, out: Path | None = typer.Option(None)) -> None:
    """Verify step time: mixed verification lengths vs uniform, same total tokens."""
    setup(num_threads)
    from dspark.bench.batching import bench_batching
    from dspark.models.target.loader import load_target

    emit(bench_batching(load_target(target, device, dtype)), out)


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
    from dspark.bench.serve_config import load_serve_args
    from dspark.prompts.eval_sets import load_turns

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
    emit(res, out)


def _front_door(kind: str) -> contextlib.AbstractContextManager[str]:
    """The front door of the cluster this command starts, for the command's duration (the environment is
    restored after it: commands run in-process, e.g. from tests, leave no switch behind)."""
    from dspark.cluster.ingress.front_door import front_door_environment

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
    client_procs: int | None = typer.Option(None, min=1, help="Processes the load comes from (each with its own "
                                            "event loop and a share of the requests); default one per core, "
                                            "at least 2."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE override of the application's args."),
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """Overload: N x the limit at N x the capacity, then at once; 429 + Retry-After latency, memory."""
    import yaml

    from dspark.bench.overload import run_overload
    from dspark.bench.serve_config import load_serve_args

    try:
        args = load_serve_args(config)
        for item in set_:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
            args[key.strip()] = yaml.safe_load(value)
        with _front_door(front_door) as door:
            res = {**run_overload(args, multiple, max_tokens, rss_bound_mb, rss_margin_mb, burst=burst,
                                  repeat=repeat, modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
                                  client_procs=client_procs),
                   "front_door": door}
    except (OSError, ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    emit(res, out)


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
    num_requests: int | None = typer.Option(None, min=1, help="Requests per level (default max(2·waves·C, 8); at "
                                            "least C)."),
    waves: int = typer.Option(1, min=1, help="Default requests per level: 2·waves·C (with --interleave, waves·C per "
                              "pass). 1: each client sends one request per pass, so a level ends with its slowest "
                              "request; more: clients send again as theirs finish (continuous batching)."),
    max_tokens: int = typer.Option(64, min=1, help="Output tokens per request (EOS ignored)."),
    temperature: float = typer.Option(0.0, min=0.0),
    seed: int = typer.Option(0, help="Request i sends seed + i."),
    num_warmup: int = typer.Option(2, min=0, help="Uncounted warm-up requests (16 tokens) before each level "
                                   "and pass, at least one per client (0: none)."),
    max_num_seqs: int | None = typer.Option(None, min=1, help="Server batch cap (default: highest level)."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE ServeAppConfig override for every arm "
                                   "(YAML value, e.g. --set num_cpus_per_replica=2); arm values win."),
    peer_url: str | None = typer.Option(None, help="Running OpenAI-compatible server (e.g. vLLM) to load "
                                        "as the extra arm 'peer', e.g. http://host:8000."),
    peer_model: str | None = typer.Option(None, help="`model` sent to --peer-url."),
    timeout_s: float = typer.Option(600.0, min=1.0, help="Per-request timeout."),
    keep_requests: bool = typer.Option(False, help="Keep per-request records in the JSON."),
    interleave: bool = typer.Option(False, help="Start all arms at once (route /<arm>) and run each level in "
                                    "passes of half the requests, arms in order then reversed, so slow "
                                    "drift of a shared machine hits every arm alike."),
    passes: int = typer.Option(2, min=2, help="With --interleave: passes per level (A..Z, Z..A, A..Z, ...); each "
                               "one more sends the level's half again, on further prompts. More passes, tighter "
                               "ratios on a drifting machine."),
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
                          num_requests=num_requests, num_warmup=num_warmup, timeout_s=timeout_s, waves=waves)
        cfg = ServeBenchConfig(arms=arm_map, base=base, concurrency=levels, load=load, peer_url=peer_url,
                               peer_model=peer_model, keep_requests=keep_requests, interleave=interleave,
                               alone=alone, peer_pid=peer_pid, passes=passes)
        with _front_door(front_door) as door:
            res = {**run_serve_bench(cfg), "front_door": door}
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if out:  # the measurements are on disk before anything else can fail
        emit(res, out, echo=False)
    if plot_dir:
        plot_dir.mkdir(parents=True, exist_ok=True)
        res["plots"] = [str(plot_serve_throughput_vs_tps_user(res, plot_dir / "serve_throughput_vs_tps_user.png")),
                        str(plot_serve_verify_len(res, plot_dir / "serve_verify_len.png"))]
        for arm, body in res["arms"].items():  # the last level's per-step spans of both pools
            stats = (body.get("levels") or [{}])[-1].get("server_stats")
            if stats and (png := plot_worker_timeline(stats, plot_dir / f"serve_timeline_{arm}.png")):
                res["plots"].append(str(png))
    emit(res, out)


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
    setup(num_threads)
    from dspark.bench.plots import plot_roofline
    from dspark.bench.roofline import run_roofline

    res = run_roofline(target, [d for d in dtypes.split(",") if d], device,
                       tuple(int(b) for b in batch_sizes.split(",") if b), context_len, row_invariant)
    if plot:
        res["plot"] = str(plot_roofline(res, plot))
    emit(res, out)


@bench_app.command("generic")
def bench_generic_cmd(
    tokenizer: str = typer.Option("smollm2-135m-instruct", help="Tokenizer of the tiny targets (a HF folder or the "
                                  "embedded default's name)."),
    families: str = typer.Option("olmo2,granite", help="Comma-separated families only the generic path serves "
                                 "(dspark/bench/tiny_targets.py), each beside the same-size Llama."),
    also_target: list[str] = typer.Option([], "--also-target", help="A real target measured through both paths "
                                          "too, e.g. smollm2-135m-instruct (repeatable)."),
    num_requests: int = typer.Option(8, min=1), prompt_len: int = typer.Option(24, min=4),
    max_tokens: int = typer.Option(32, min=1), num_repeats: int = typer.Option(3, min=1),
    hidden_size: int = typer.Option(64, min=16), num_layers: int = typer.Option(2, min=1),
    num_threads: int | None = THREADS,
    out: Path | None = typer.Option(None, help="Also write the JSON here."),
) -> None:
    """The cost of being generic: the native runner beside the generic transformers path (same Llama through
    both; generic-only architectures beside it), target-only and n-gram, interleaved; JSON last."""
    setup(num_threads)
    from dspark.bench.generic_cost import run_generic_cost

    emit(run_generic_cost(tokenizer, tuple(f for f in families.split(",") if f), tuple(also_target), num_requests,
                          prompt_len, max_tokens, num_repeats, hidden_size, num_layers), out)


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
    setup(num_threads)
    from dspark.bench.generate import run_generate_bench

    emit(run_generate_bench(target, num_prompts_before, num_prompts_after, max_tokens), out)


@bench_app.command("transport")
def bench_transport_cmd(
    rows: str = typer.Option("16,128,512", help="Feature rows per message (tokens that entered the KV cache)."),
    num_features: int = typer.Option(3 * 576, min=1, help="Columns per row: taps × hidden (SmolLM2: 3 × 576)."),
    reps: int = typer.Option(30, min=1, help="Round trips per size (after 2 warm-up)."),
    out: Path | None = typer.Option(None),
) -> None:
    """Draft<->verify transports between two Ray actors: a TCP socket and gloo point-to-point vs Ray object refs."""
    import ray

    from dspark.actors.transport_probe import measure_transports

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        res = measure_transports([int(r) for r in rows.split(",") if r], num_features, reps)
    finally:
        ray.shutdown()
    emit(res, out)
