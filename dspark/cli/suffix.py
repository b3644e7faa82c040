"""`dspark suffix ...`: build the suffix proposer's index, calibrate its sources, plot τ against corpus size."""

from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from dspark.models.drafters.suffix.drafter import SuffixConfig

suffix_app = typer.Typer(no_args_is_help=True, help="The training-free suffix proposer (drafter: suffix / hybrid).")

SUFFIX_DIR = typer.Option(Path("checkpoints/suffix-smollm2"), help="The suffix folder (config.json, calibration.json).")


def _setup(num_threads: int | None) -> None:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if num_threads:
        torch.set_num_threads(num_threads)


@suffix_app.command("build")
def build_cmd(path: Path = SUFFIX_DIR, fresh: bool = typer.Option(False, help="Ignore a persisted index."),
              num_requests: int = typer.Option(32, min=0, help="Also time one proposal round for this many requests "
                                               "(eval-set prompts + 128 greedy-free tokens of context; 0: skip)."),
              ) -> None:
    """Build (or load) the global index of the folder's corpus: tokens, memory, wall time, and the cost of one
    proposal round (both sources, calibrated survival) for `num_requests` requests (JSON)."""
    _setup(None)
    import tempfile

    from dspark.models.drafters.suffix.corpus import corpus_paths, read_responses
    from dspark.models.drafters.suffix.drafter import SuffixConfig
    from dspark.models.drafters.suffix.index import SuffixIndex

    config = SuffixConfig.from_dict(json.loads((path / "config.json").read_text()))
    t0 = time.perf_counter()
    docs = read_responses(corpus_paths(config.corpus_dirs), config.heldout_fraction,
                          max_tokens=config.corpus_max_tokens)
    t_read = time.perf_counter() - t0
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    root = Path(tempfile.mkdtemp()) if fresh else None
    index = SuffixIndex.cached(docs, root=root)
    t_index = time.perf_counter() - t0 - t_read
    t1 = time.perf_counter()
    index = SuffixIndex.cached(docs, root=root)  # the persisted copy, as a replica's start-up loads it
    t_load = time.perf_counter() - t1
    propose_ms = _propose_cost(path, index, config, num_requests) if num_requests else None
    # at T > 0 the drafts are drawn from q and carry it (SparseQ)
    propose_ms_t1 = _propose_cost(path, index, config, num_requests, temperature=1.0) if num_requests else None
    typer.echo(json.dumps({"num_tokens": index.num_tokens, "num_documents": len(docs),
                           "propose_ms_per_round": propose_ms, "propose_ms_per_round_t1": propose_ms_t1,
                           "num_requests": num_requests,
                           "index_mb": round(index.nbytes / 2**20, 1),
                           "mb_per_10m_tokens": round(index.nbytes / 2**20 / max(1, index.num_tokens) * 1e7, 1),
                           "read_s": round(t_read, 2), "build_or_load_s": round(t_index, 2),
                           "load_persisted_s": round(t_load, 2),
                           "peak_rss_mb": round(max(rss0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024)}))


def _propose_cost(path: Path, index: object, config: SuffixConfig, num_requests: int, num_rounds: int = 200,
                  temperature: float = 0.0) -> dict:
    """Median and p90 ms of one `propose` round (the folder's walk parameters and sources) over `num_requests`
    requests whose contexts are eval prompts followed by a continuation taken from the index's own text (so the
    walks find matches, as in serving); at `temperature` > 0 the drafts are drawn from q and the round includes
    building their q rows."""
    import statistics

    import numpy as np
    from transformers import AutoTokenizer

    from dspark.models.drafters.base import DraftRequest
    from dspark.models.drafters.suffix.drafter import SuffixDrafter
    from dspark.models.target.loader import resolve_target_path
    from dspark.prompts.eval_sets import mixed_prompts
    from dspark.spec.source_calibration import SourceCalibration

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
    cal = path / "calibration.json"
    drafter = SuffixDrafter(index, SourceCalibration.load(cal) if cal.exists() else None,  # type: ignore[arg-type]
                            config)
    rng = np.random.default_rng(0)
    text = index.text  # type: ignore[attr-defined]
    reqs, cursors = [], []
    for i, (_, ids) in enumerate(mixed_prompts(tok, num_requests)):
        start = int(rng.integers(0, len(text) - 128 - num_rounds))
        reqs.append(DraftRequest(f"r{i}", ids + [int(t) for t in text[start:start + 128] if t >= 0], temperature))
        cursors.append(start + 128)
    times = []
    for _ in range(num_rounds):
        for q, c in zip(reqs, cursors):  # each round the context grows by one token, as decoding appends
            q.token_ids.append(int(max(text[c % len(text)], 0)))
        cursors = [c + 1 for c in cursors]
        t0 = time.perf_counter()
        drafter.propose(reqs, 7)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median": round(statistics.median(times), 3), "p90": round(times[int(0.9 * len(times))], 3)}


@suffix_app.command("calibrate")
def calibrate_cmd(
    path: Path = SUFFIX_DIR,
    num_prompts: int = typer.Option(96, min=2, help="Held-out prompts per temperature (half fit, half judge)."),
    max_new_tokens: int = typer.Option(128, min=8),
    temperature: list[float] = typer.Option([0.0, 1.0], "--temperature"),
    heldout_fraction: float = typer.Option(0.06, help="The prompt-hash split left out of the index."),
    gamma: int = typer.Option(7, min=1),
    batch_size: int = typer.Option(16, min=1),
    target: str = typer.Option("smollm2-135m-instruct"),
    num_threads: int | None = typer.Option(None),
    write: bool = typer.Option(True, help="Write calibration.json into the folder."),
    empirical_q: bool = typer.Option(True, help="T > 0: drafts drawn from q (the 'empirical' regime), else the "
                                                "deterministic walk verified as a point mass ('sampled')."),
    keep_tables: bool = typer.Option(False, help="Keep the folder's tables; fit only the prefix-survival scaling "
                                     "(on rounds the tables were not fitted on: the held-out split's odd prompts)."),
) -> None:
    """Fit each source's survival on held-out self-distilled prompts; print held-out ECE per source (JSON)."""
    _setup(num_threads)
    from tqdm import tqdm

    from dspark.config.engine import EngineConfig
    from dspark.models.drafters.suffix.corpus import corpus_paths, read_heldout_prompts
    from dspark.models.drafters.suffix.drafter import SuffixDrafter
    from dspark.spec.source_calibration import SourceCalibration, regime_of
    from dspark.training.suffix_calibrate import RoundLog, collect, fit_scalings, heldout_ece
    from dspark.verify_service.engine import Engine

    shipped = path / "calibration.json"
    if keep_tables and not shipped.exists():
        typer.echo(f"error: --keep-tables: no {shipped} to keep", err=True)
        raise typer.Exit(2)
    kept = SourceCalibration.load(shipped).tables if keep_tables else None
    drafter = SuffixDrafter.from_pretrained(path, heldout_fraction=heldout_fraction, explore=True,
                                            empirical_q=empirical_q)
    drafter.calibration = SourceCalibration()  # fitted from scratch
    engine = Engine(EngineConfig(target=target, drafter="custom", scheduler="fixed", scheduler_kwargs={"k": gamma},
                                 num_draft_tokens=gamma, max_num_seqs=batch_size, max_model_len=2048),
                    drafter=drafter)
    records = read_heldout_prompts(corpus_paths(drafter.config.corpus_dirs), heldout_fraction, num_prompts)
    prompts = [r["prompt_ids"] for r in records if len(r["prompt_ids"]) + max_new_tokens + gamma + 2 <= 2048]
    fit, scale, held = SourceCalibration(), RoundLog(), RoundLog()
    t0 = time.perf_counter()
    with tqdm(desc="calibrate", unit="tok", total=len(prompts) * max_new_tokens * len(temperature)) as bar:
        for temp in temperature:
            collect(engine, drafter, prompts, temp, max_new_tokens, batch_size, 0, fit, scale, held, bar)
    if kept is not None:
        fit.tables = kept
    tables_only = heldout_ece(fit, held.picked(fit), gamma)
    scalings = fit_scalings(fit, scale, held, gamma)
    report = {"num_prompts": len(prompts), "temperatures": temperature, "wall_s": round(time.perf_counter() - t0, 1),
              "tables": "kept" if keep_tables else "fitted",
              "trials": {r: {s: t.num_trials for s, t in by.items()} for r, by in fit.tables.items()},
              "scaling": scalings,  # each fitted scaling, and whether it lowered its source's held-out ECE
              # on the held-out rounds the serving rule picks each source in (under the calibration judged):
              # the survival the scheduler reads; and on every round the explore mode verified
              "heldout_ece": heldout_ece(fit, held.picked(fit), gamma),
              "heldout_ece_without_scaling": tables_only,
              "heldout_ece_all_rounds": heldout_ece(fit, held, gamma),
              "uncalibrated_ece": heldout_ece(SourceCalibration(), held.picked(SourceCalibration()), gamma)}
    if write:  # the regimes this run did not measure keep the tables and scalings they had
        if shipped.exists():
            before = SourceCalibration.load(shipped)
            for regime, tables in before.tables.items():
                fit.tables.setdefault(regime, tables)
            for (source, regime), params in before.scaling.items():
                if regime not in {regime_of(t, empirical_q) for t in temperature}:
                    fit.scaling.setdefault((source, regime), params)
        fit.save(shipped)
        report["written"] = str(shipped)
    typer.echo(json.dumps(report))


@suffix_app.command("curve")
def curve_cmd(
    path: Path = SUFFIX_DIR,
    sizes: str = typer.Option("400000,800000,1600000,3200000,0", help="Corpus sizes in tokens (0 = all)."),
    datasets: list[str] = typer.Option(["gsm8k", "humaneval", "mbpp", "mt-bench"], "--datasets"),
    num_prompts: int = typer.Option(10, min=1),
    max_new_tokens: int = typer.Option(128, min=8),
    out: Path = typer.Option(Path("docs/results/suffix/tau_vs_corpus.png")),
    target: str = typer.Option("smollm2-135m-instruct"),
    num_threads: int | None = typer.Option(None),
) -> None:
    """τ at T=0 of the corpus source alone and of both sources, against the corpus size (PNG + JSON)."""
    _setup(num_threads)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dspark.models.drafters.suffix.drafter import SuffixDrafter
    from dspark.models.target.loader import load_target
    from dspark.training.evaluate import evaluate

    tgt = load_target(target)
    rows = []
    for size in [int(s) for s in sizes.split(",")]:
        for sources in (["corpus"], ["request", "corpus"]):
            d = SuffixDrafter.from_pretrained(path, corpus_max_tokens=size or None, sources=sources)
            rep = evaluate(tgt, d, datasets, [0.0], num_prompts, max_new_tokens, 7)
            run = rep["runs"]["0.0"]
            rows.append({"corpus_tokens": d.index.num_tokens if d.index else 0, "sources": "+".join(sources),
                         "tau": run["tau"], "tau_macro": run["tau_macro"]})
            typer.echo(json.dumps(rows[-1]), err=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for sources in ("corpus", "request+corpus"):
        pts = [r for r in rows if r["sources"] == sources]
        ax.plot([r["corpus_tokens"] / 1e6 for r in pts], [r["tau_macro"] for r in pts], marker="o",
                label=f"{sources} (macro)")
    ax.set_xscale("log")
    ax.set_xlabel("corpus size (M response tokens, log)")
    ax.set_ylabel("τ at T=0 (γ=7)")
    ax.set_title("Suffix proposer: τ against the size of the target's own text")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    (out.with_suffix(".json")).write_text(json.dumps(rows, indent=1))
    typer.echo(json.dumps({"plot": str(out), "rows": rows}))
