"""Which SPS profile an engine schedules against: the one measured on THIS machine, model and dtype.

A profile measured on another CPU (or in another dtype) describes another throughput curve: an AVX2
EPYC pays ~2x for verifying 8 tokens instead of 1 at batch 1 in fp32, an AMX Xeon in bf16 far less,
and the prefix scheduler's choices follow that curve. So each profile records what it was measured on
(`meta.hardware`: model name, ISA flags and CPUID family and model, `kernels/machine.py`; `meta.model`,
`meta.dtype`, `meta.device`, on a CPU `meta.num_threads`: a 1-thread replica's curve has another shape than a
2-thread one), the engine looks for
a match among the shipped profiles (`configs/profiles/`) and the ones it measured before
(``~/.cache/dspark/profiles/<native kernel build>/``: a profile measured with other kernels describes another
curve, so a rebuilt kernel is measured again, as the GEMM plan is), and measures one now (a short grid,
seconds; once per machine and build, cached) when none matches. `dspark prepare` does that before the cluster starts.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.kernels import cache_once, native
from dspark.kernels.cache_once import cache_dir
from dspark.kernels.machine import cpu_signature, same_cpu
from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import TargetModel
from dspark.models.target.runner import TargetRunner
from dspark.spec.sps import SPSTable

log = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parents[3] / "configs" / "profiles"
# what a start-up measurement covers: seconds, not minutes, on two cores shared with other replicas
STARTUP_GRID = (1, 2, 4, 8, 16, 32, 64)
STARTUP_CONTEXT = 64
STARTUP_REPEATS = 3  # odd: the median of each size drops one burst of noise
STARTUP_MIN_TIME_S = 1.0  # more rounds while they fit: a tiny model's ~1 ms steps get a stable median
STARTUP_MAX_REPEATS = 25


def shipped_dir() -> Path:
    """The shipped profiles (``$DSPARK_PROFILES_DIR`` replaces them: an empty folder = an unknown CPU)."""
    return Path(os.environ.get("DSPARK_PROFILES_DIR", SHIPPED_DIR))


def measured_dir() -> Path:
    """Where this machine's own profiles go: one folder per build of the native kernels (the shipped ones are
    measured again by hand, `dspark profile`, when the kernels change)."""
    return cache_dir() / "profiles" / (native.build_id() or "pytorch")


def profile_dirs() -> list[Path]:
    """Where profiles are looked up: the shipped ones first, then the ones measured on this machine."""
    return [shipped_dir(), measured_dir()]


def machine_identity(target_name: str, device: torch.device | str, dtype: torch.dtype,
                     num_threads: int | None = None) -> dict:
    """What a profile must have been measured on to describe this engine's throughput. On a CPU that
    includes the torch threads (default: this process's): a 1-thread replica's curve is not a 2-thread
    one scaled (at 32 tokens a step is ~1.7x slower, but the next 32 cost about the same), and the
    prefix scheduler's choices follow the curve's shape."""
    dev = torch.device(device)
    hw = ({"gpu": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else cpu_signature())
    ident = {"hardware": hw, "model": Path(target_name).name, "dtype": str(dtype).removeprefix("torch."),
             "device": dev.type}
    if dev.type == "cpu":
        ident["num_threads"] = int(num_threads or torch.get_num_threads())
    return ident


def identity_of(meta: dict) -> dict | None:
    """The identity a profile's meta records, or None for a profile that does not say (not matched)."""
    if "hardware" not in meta:
        return None
    ident = {"hardware": meta["hardware"], "model": Path(str(meta.get("model", ""))).name,
             "dtype": meta.get("dtype"), "device": meta.get("device", "cpu")}
    if ident["device"] == "cpu":
        ident["num_threads"] = meta.get("num_threads")
    return ident


def slug(identity: dict) -> str:
    """A file name for a profile: cpu-<isa>-<model name>[-f<family>m<model>]-<model>-<dtype>[-<threads>t]."""
    hw = identity["hardware"]
    if "gpu" in hw:
        name = f"cuda-{hw['gpu']}"
    else:
        flags = set(hw["flags"])
        isa = "amx" if "amx_bf16" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags \
            else "generic"
        name = f"cpu-{isa}-{hw['model']}" + (f"-f{hw['cpuid'].replace('-', 'm')}" if hw.get("cpuid") else "")
    threads = f"-{identity['num_threads']}t" if identity.get("num_threads") else ""
    raw = f"{name}-{identity['model']}-{identity['dtype']}{threads}".lower()
    return "".join(c if c.isalnum() else "-" for c in raw).strip("-").replace("--", "-")


def _profile_metas(dirs: list[Path] | None = None):  # noqa: ANN202 - a generator of (path, meta)
    """(path, meta) of every readable profile: shipped ones first, then the ones measured here."""
    for d in dirs if dirs is not None else profile_dirs():
        for path in sorted(d.glob("*.json")) if d.is_dir() else []:
            try:
                yield path, json.loads(path.read_text()).get("meta") or {}
            except (OSError, ValueError):
                continue


def matches(recorded: dict | None, identity: dict) -> bool:
    """Whether a profile's recorded identity describes `identity`: the same model, dtype, device and threads, and
    the same GPU or CPU (`same_cpu`: a profile that records the CPU's family and model matches only that one)."""
    if recorded is None or {**recorded, "hardware": None} != {**identity, "hardware": None}:
        return False
    hw, here = recorded["hardware"], identity["hardware"]
    return hw == here if "gpu" in here or "gpu" in hw else same_cpu(hw, here)


def _matching(identity: dict, dirs: list[Path] | None = None,
              as_recorded: Callable[[dict], dict | None] = identity_of) -> list[tuple[Path, dict]]:
    """(path, meta) of the profiles whose identity (`as_recorded(meta)`) `matches` `identity`: those recorded on this
    CPU's family and model first, then the ones that do not say; each group shipped ones first, then measured ones."""
    found = [(path, meta) for path, meta in _profile_metas(dirs) if matches(as_recorded(meta), identity)]
    return sorted(found, key=lambda pm: "cpuid" not in pm[1]["hardware"])  # stable: the folders' order within


def find_profile(identity: dict, dirs: list[Path] | None = None) -> Path | None:
    """The profile file that describes `identity` best (`_matching`), or None."""
    return next((path for path, _ in _matching(identity, dirs)), None)


def profile_for(target: TargetModel, dirs: list[Path] | None = None) -> tuple[SPSTable, Path]:
    """The SPS table of this machine for `target`: found, or measured now (once per machine, under a lock:
    the other processes wait and read it) and cached. `dirs`: where to look (default `profile_dirs()`)."""
    identity = machine_identity(target.name, target.device, target.dtype)
    path = find_profile(identity, dirs)
    if path is None:
        out = measured_dir() / f"{slug(identity)}.json"
        with cache_once.locked(f"profile-{slug(identity)}"):
            path = find_profile(identity, dirs)
            if path is None:
                log.warning("no SPS profile for %s: measuring a short one now (cached for next time)", identity)
                cache_once.remove_stale(out)
                cache_once.publish_json(out, measure_startup_profile(target).to_dict())
                path = out
    log.info("SPS profile %s matches this machine", path)
    return SPSTable.from_file(path), path


def measure_startup_profile(target: TargetModel) -> SPSTable:
    """A short profile (STARTUP_GRID, few repeats): seconds on a small CPU, enough for the scheduler to
    know where verifying more tokens stops paying; `dspark profile` measures the full one."""
    t0 = time.perf_counter()
    table = profile_target(target, STARTUP_GRID, context_len=STARTUP_CONTEXT, num_repeats=STARTUP_REPEATS,
                           num_warmup=1, show_progress=False, min_time_s=STARTUP_MIN_TIME_S,
                           max_repeats=STARTUP_MAX_REPEATS)
    table.meta.update(machine_identity(target.name, target.device, target.dtype))
    table.meta["measured_at_startup_s"] = round(time.perf_counter() - t0, 1)
    log.info("SPS profile measured in %.1f s", table.meta["measured_at_startup_s"])
    return table


def load_sps(sps_profile: str | None, target: TargetModel) -> SPSTable:
    """The profile at `sps_profile`, else the one measured on this machine for this target and dtype."""
    if sps_profile:
        path = Path(sps_profile)
        if not path.exists():
            raise FileNotFoundError(f"SPS profile {path} not found: run `dspark profile --out {path}`")
        table = SPSTable.from_file(path)
    else:
        table, _ = profile_for(target)
    return table.monotone()


def recorded_dtype_choice(target_name: str, device: str) -> dict | None:
    """The per-role dtype measurement `dspark profile` stored with a profile of this machine and model
    (at any thread count)."""
    def any_dtype_or_threads(meta: dict) -> dict | None:
        ident = identity_of(meta)
        return {**ident, "dtype": "float32", "num_threads": None} if ident is not None and "dtypes" in meta else None

    want = {**machine_identity(target_name, device, torch.float32), "num_threads": None}
    return next((meta["dtypes"] for _, meta in _matching(want, as_recorded=any_dtype_or_threads)), None)


# ---- `dspark profile`: target step time against tokens per step, written as an SPS profile ----
DEFAULT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
# `dspark profile`'s rows in a batched decode step's shape (`SPSTable.for_requests`): R requests of one token, plus
# n verified drafts spread over them (at most tokens_per_request - 1 each)
REQUEST_GRID = (2, 4, 8, 16, 32)
EXTRA_GRID = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_target(target: TargetModel, grid: tuple[int, ...] = DEFAULT_GRID, context_len: int = 256,
                   tokens_per_request: int = 8, num_repeats: int = 5, num_warmup: int = 2,
                   show_progress: bool = True, row_invariant: bool = True, min_time_s: float = 0.0,
                   max_repeats: int | None = None, request_grid: tuple[int, ...] = ()) -> SPSTable:
    """Median step time of verification-shaped batches: B tokens as ⌈B/8⌉ requests of ≤ 8 tokens,
    each over `context_len` cached tokens (the shape a batch-1 verify step has). With `request_grid`, also a row
    per R in it (`by_requests`): R requests of one token and n = EXTRA_GRID verified drafts spread over them, at
    most tokens_per_request - 1 each (a batched decode step's shape). `row_invariant`: the verify
    engine's kernels (the default; what the schedulers' profile describes), else the generation path's.
    After `num_repeats` rounds, further rounds while the timing has taken less than `min_time_s` (up to
    `max_repeats`): fast steps get enough samples for their median to drop a burst of noise."""
    max_reqs = max(-(-max(grid) // tokens_per_request), *request_grid, 1)
    runner = TargetRunner(target.model, max_reqs, context_len + tokens_per_request + 1, row_invariant=row_invariant)
    slots = [runner.cache.allocate() for _ in range(max_reqs)]
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, runner.vocab_size, (context_len,), generator=gen).tolist()
    runner.forward([SeqChunk(s, 0, ctx, 1) for s in slots])  # fill every slot's context once
    batches = []
    for num_tokens in grid:
        sizes = [tokens_per_request] * (num_tokens // tokens_per_request)
        if num_tokens % tokens_per_request:
            sizes.append(num_tokens % tokens_per_request)
        batches.append([SeqChunk(slots[i], context_len, ctx[:n], n) for i, n in enumerate(sizes)])
    rows = [(r, r + n) for r in request_grid for n in EXTRA_GRID
            if n <= (tokens_per_request - 1) * r and r + n <= max(grid)]
    for r, num_tokens in rows:
        sizes = [1 + (num_tokens - r) // r + (i < (num_tokens - r) % r) for i in range(r)]
        batches.append([SeqChunk(slots[i], context_len, ctx[:n], n) for i, n in enumerate(sizes)])
    for chunks in batches:
        for _ in range(num_warmup):
            runner.forward(chunks)
    # round-robin: each repeat times every size once, so a burst of noise from a shared host lands on
    # one sample of many sizes (the median drops it) instead of on every sample of one size
    samples: list[list[float]] = [[] for _ in batches]
    bar = tqdm(total=num_repeats * len(batches), desc="profile", unit="step", disable=not show_progress)
    max_repeats = max(num_repeats, max_repeats or num_repeats)
    started = time.perf_counter()
    for round_ in range(max_repeats):
        if round_ >= num_repeats and time.perf_counter() - started >= min_time_s:
            break
        for chunks, out in zip(batches, samples):
            # each timed step right after an untimed one of its own size, as a decode's steps follow steps of about
            # their size: a 1-token step timed right after the round's 256-token one read 0.7-0.9 ms (8-9 %) slower
            # than the next one (Zen 5 EPYC, docs/results/suffix/s59/profile/after_big.py), and T(1) is the
            # denominator of every batch-1 cost ratio the scheduler reads
            runner.forward(chunks)
            _sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(chunks)
            _sync(runner.device)
            out.append((time.perf_counter() - t0) * 1e3)
            bar.update()
    bar.close()
    medians = [statistics.median(s) for s in samples]
    times_ms = medians[:len(grid)]
    by_requests = {r: SPSTable([t for rr, t in rows if rr == r],
                               [ms for (rr, _), ms in zip(rows, medians[len(grid):]) if rr == r])
                   for r in request_grid}
    meta = {**machine_identity(target.name, target.device, target.dtype),
            "num_threads": torch.get_num_threads(), "context_len": context_len,
            "tokens_per_request": tokens_per_request, "num_repeats": len(samples[0]),
            "machine": platform.processor() or platform.machine(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _note_verify_cost(meta, dict(zip(grid, times_ms)))
    return SPSTable(tokens_per_step=list(grid), step_time_ms=times_ms, meta=meta, by_requests=by_requests)


def _note_verify_cost(meta: dict, by_tokens: dict[int, float]) -> None:
    """meta's `verify_cost_ratio`: the number that decides when speculation pays, T(1 + ℓ) / T(1) at batch 1."""
    if 1 in by_tokens:
        meta["verify_cost_ratio"] = {str(n - 1): round(by_tokens[n] / by_tokens[1], 3)
                                     for n in (2, 4, 8) if n in by_tokens and n <= meta["tokens_per_request"]}


def median_of_runs(runs: list[SPSTable]) -> SPSTable:
    """One table from `profile_target` runs of one grid taken one after another: each size's median over the runs.

    A run's rounds go round the grid, so a burst of noise lands on one sample of many sizes and each size's median
    drops it; a shared host's slow stretches last minutes, longer than a run (~1.5 min for SmolLM2's grid on two
    cores), and move a whole run. Eight runs on a 2-core Zen 5 KVM read T(20) 14.8-22.2 ms and T(1) 8.9-11.1 ms, one
    run 10-25 % faster than the others at every size (docs/results/suffix/README.md, session 60): the table the
    scheduler reads should not be one stretch's. meta: the last run's, with `runs` and each size's range over them
    (`range_ms`)."""
    grid = runs[-1].tokens_per_step
    shape = {r: row.tokens_per_step for r, row in runs[-1].by_requests.items()}
    if any(r.tokens_per_step != grid or {k: row.tokens_per_step for k, row in r.by_requests.items()} != shape
           for r in runs):
        raise ValueError("profile runs of different grids cannot be combined")
    per_size = list(zip(*(r.step_time_ms for r in runs)))
    times = [statistics.median(ms) for ms in per_size]
    meta = {**runs[-1].meta, "runs": len(runs),
            "range_ms": {str(n): [round(min(ms), 3), round(max(ms), 3)] for n, ms in zip(grid, per_size)}}
    _note_verify_cost(meta, dict(zip(grid, times)))
    rows = {r: SPSTable(list(xs), [statistics.median(ms) for ms in zip(*(run.by_requests[r].step_time_ms
                                                                          for run in runs))])
            for r, xs in shape.items()}
    return SPSTable(tokens_per_step=list(grid), step_time_ms=times, meta=meta, by_requests=rows)
