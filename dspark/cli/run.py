"""`dspark generate | profile | prepare`: running the engine: one generation, the SPS profile of this machine,
the first start's work (`make serve` runs `dspark prepare` before the cluster starts)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from dspark.cli.common import DEVICE, DTYPE, TARGET, THREADS, setup


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
    setup(num_threads)
    from dspark.config.engine import EngineConfig
    from dspark.prompts.eval_sets import chat_prompt_ids
    from dspark.verify_service.engine import Engine
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


def profile(
    out_dir: Path = typer.Option(Path("configs/profiles"), help="Where the profiles go (one per dtype)."),
    target: str = TARGET, device: str = DEVICE,
    dtypes: str = typer.Option("auto", help="Comma-separated dtypes to profile; auto: every candidate this "
                               "machine has (fp32, and bf16 where it has bf16 units or is a GPU)."),
    max_tokens_per_step: int = typer.Option(256, min=1),
    context_len: int = typer.Option(256, min=1),
    num_repeats: int = typer.Option(5, min=1),
    runs: int = typer.Option(1, min=1, help="Whole measurements one after another, each size's median over them "
                             "(a shared host's slow stretches last minutes; 5 for a profile to ship)."),
    request_rows: bool = typer.Option(True, help="Also time batched decode steps (R requests of one token plus "
                                      "verified drafts spread over them, R = 2 ... 32): the rows the scheduler prices "
                                      "a step of R requests on (`SPSTable.for_requests`)."),
    num_threads: int | None = THREADS,
) -> None:
    """Measure the fastest dtype per role and, per dtype, target step time vs tokens per step (SPS)."""
    setup(num_threads)
    from dspark.models.target.dtype_choice import candidate_dtypes, measure_dtypes
    from dspark.models.target.loader import load_target
    from dspark.models.target.profiles import DEFAULT_GRID, REQUEST_GRID, median_of_runs, profile_target, slug

    grid = tuple(b for b in DEFAULT_GRID if b <= max_tokens_per_step)
    request_grid = tuple(r for r in REQUEST_GRID if r <= max_tokens_per_step) if request_rows else ()
    chosen = candidate_dtypes(device) if dtypes == "auto" else [d for d in dtypes.split(",") if d]
    choice = measure_dtypes(target, device)
    targets = {dtype: load_target(target, device, dtype) for dtype in chosen}
    by_dtype: dict[str, list] = {dtype: [] for dtype in chosen}
    for _ in range(runs):  # each dtype's runs spread over the whole measurement
        for dtype in chosen:
            by_dtype[dtype].append(profile_target(targets[dtype], grid, context_len, num_repeats=num_repeats,
                                                  request_grid=request_grid))
    results = []
    for dtype in chosen:
        table = median_of_runs(by_dtype[dtype])  # one run: itself, with its range
        table.meta["dtypes"] = choice
        path = out_dir / f"{slug(table.meta)}.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        table.save(path)
        results.append({"out": str(path), "dtype": dtype, **table.to_dict(),
                        "sps": [round(table.sps(b), 3) for b in table.tokens_per_step]})
    typer.echo(json.dumps({"dtype_choice": choice, "profiles": results}))


def prepare(config: Path = typer.Option(Path("configs/serve.yaml"), help="The Serve config whose arms to "
                                        "prepare (target, dtype, drafter of each)."),
            verbose: bool = typer.Option(False, help="Log each step's details.")) -> None:
    """Convert the target, build the native kernels, measure the dtype, GEMM plans and SPS profile of every
    arm of a serve config, once per machine, into the cache (`make serve` runs it before `serve run`)."""
    from dspark.cluster.prepare import prepare as run_prepare
    from dspark.kernels.cache_once import PrepareError

    setup(None, verbose)
    try:
        res = run_prepare(config)
    except (PrepareError, OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(json.dumps(res))
