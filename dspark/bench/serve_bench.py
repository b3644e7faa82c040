"""`dspark bench serve`: the same closed-loop load against several server arms, side by side in one run.

An arm is a dict of ServeAppConfig overrides (so arms keep working as fields are added). By default each
is started as a Ray Serve app on one HTTP port, swept over the concurrency levels, and deleted before the
next. `interleave` starts every arm at once, each under its own route prefix and with its own named
actors, and runs each level in passes (two by default, `passes` in all) with half the requests each, arms in
order and then in reverse (A B C, C B A, A B C, ...): a machine that drifts over minutes then shifts every arm
alike, and the passes show how far one arm's figure moves between them. Each arm's requests are also paired
with the reference arm's (same prompt, same pass: serve_pairs.py), a ratio drift barely moves. An already
running OpenAI-compatible server (e.g. vLLM) can join as the extra arm "peer". The summary gives throughput
and TPS/user ratios per level against `no-spec` and `fixed-k` and a few pass/fail flags.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from dspark.actors.transport import free_port as free_port
from dspark.bench.cpu_time import cores_used, measure, snapshot
from dspark.bench.load import (
    LevelResult,
    LoadConfig,
    Messages,
    fetch_server_stats,
    merge_levels,
    num_requests_for,
    output_throughput,
    run_level_sync,
    summarize_level,
)
from dspark.bench.peer_process import paused
from dspark.bench.serve_fairness import fairness_summary
from dspark.bench.serve_pairs import paired_summary
from dspark.bench.serve_summary import summarize
from dspark.prompts.eval_sets import DOMAINS, load_turns

APP_NAME = "dspark-bench"
PEER_ARM = "peer"
BUILTIN_ARM_NAMES = ("no-spec", "mtp1", "fixed-k", "scheduled", "colocated", "decoupled")


def builtin_arms(drafter: str, num_draft_tokens: int) -> dict[str, dict[str, Any]]:
    """The named arms: ServeAppConfig overrides on top of the common base."""
    scheduled = {"drafter": drafter, "scheduler": "greedy", "num_draft_tokens": num_draft_tokens}
    return {
        "no-spec": {"drafter": "none", "scheduler": "fixed", "num_draft_tokens": 0},
        # the production baseline: MTP-1 (checkpoints/mtp1-smollm2), one draft token verified every step
        "mtp1": {"drafter": "mtp1", "scheduler": "fixed", "scheduler_kwargs": {"k": 1}, "num_draft_tokens": 1},
        "fixed-k": {"drafter": drafter, "scheduler": "fixed", "scheduler_kwargs": {"k": num_draft_tokens},
                    "num_draft_tokens": num_draft_tokens},
        "scheduled": scheduled,  # Algorithm 1
        # pool modes: K from the central SchedulerActor. On a 2-core host the colocated worker gets both
        # threads; decoupled splits them one for verify, one for draft (ingress and scheduler ~idle)
        "colocated": {**scheduled, "mode": "colocated", "scheduler": "central",
                      "verify_worker": {"num_cpus": 1.5, "num_threads": 2}},
        "decoupled": {**scheduled, "mode": "decoupled", "scheduler": "central",
                      "verify_worker": {"num_cpus": 1.0, "num_threads": 1},
                      "draft_worker": {"num_cpus": 0.5, "num_threads": 1}},
    }


def load_arm_config(path: Path) -> dict[str, dict[str, Any]]:
    """A YAML mapping arm name → ServeAppConfig overrides."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path}: expected a mapping of arm name -> mapping of ServeAppConfig overrides")
    return {str(k): dict(v) for k, v in data.items()}


@dataclass
class ServeBenchConfig:
    arms: dict[str, dict[str, Any]]  # name → overrides, in run order
    base: dict[str, Any] = field(default_factory=dict)  # overrides common to all arms (arm values win)
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    load: LoadConfig = field(default_factory=lambda: LoadConfig(base_url=""))
    peer_url: str | None = None
    peer_model: str | None = None
    prompts: list[Messages] | None = None  # None: domain-mixed turns from the shared eval sets
    datasets: tuple[str, ...] = tuple(DOMAINS)
    max_prompt_chars: int = 2000
    keep_requests: bool = False
    health_timeout_s: float = 600.0
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free one
    interleave: bool = False  # all arms up at once; each level in `passes` passes, A..Z, Z..A, A..Z, ...
    passes: int = 2  # with interleave: passes per level (and per level alone)
    reference_arm: str = "no-spec"  # with interleave: the arm each other arm's requests are paired with
    alone: bool = False  # with interleave: also each arm with only itself deployed (serve_fairness.py)
    peer_pid: int | None = None  # the peer server's pid: paused (SIGSTOP) while our arms take their turn
    idle_probe_s: float = 10.0  # with interleave: cores the idle apps use with no load, over this long


def arm_args(config: ServeBenchConfig, name: str) -> dict[str, Any]:
    return {**config.base, **config.arms[name]}


def validate_arms(config: ServeBenchConfig) -> None:
    """Fail before starting anything if an arm's merged args are not a valid ServeAppConfig."""
    from dspark.cluster.app import ServeAppConfig

    for name in config.arms:
        try:
            ServeAppConfig.model_validate(arm_args(config, name))
        except ValueError as exc:
            raise ValueError(f"arm {name!r}: {exc}") from exc
    if config.passes < 2:
        raise ValueError(f"passes must be at least 2 (arms in order, then reversed), got {config.passes}")
    if config.interleave:
        routes = [_route_name(name) for name in config.arms]
        if len(set(routes)) != len(routes):
            raise ValueError(f"arms {list(config.arms)} give clashing route prefixes {routes}; rename them")


def mixed_chat_prompts(num_prompts: int, datasets: tuple[str, ...], max_prompt_chars: int) -> list[Messages]:
    """Round-robin over the eval sets (first turns, in file order), so every level sees every domain."""
    per = -(-num_prompts // len(datasets)) + 4
    pools = [[t for t in load_turns(d, per) if len(t) <= max_prompt_chars] for d in datasets]
    out: list[Messages] = []
    for k in range(max(map(len, pools))):
        out += [[{"role": "user", "content": pool[k]}] for pool in pools if k < len(pool)]
    if not out:
        raise ValueError(f"no prompts of at most {max_prompt_chars} characters in {datasets}")
    return out[:num_prompts]


def fixed_pool_args(args: dict[str, Any]) -> dict[str, Any]:
    """An app's args with the pools' autoscaling taken out, at the top and in every A/B arm's overrides:
    for benchmarks whose figures a replica added or removed mid-run would change."""
    drop = ("verify_autoscaling", "draft_autoscaling")
    out = {k: v for k, v in args.items() if k not in drop}
    if out.get("ab_arms"):
        out["ab_arms"] = [{**a, "overrides": {k: v for k, v in (a.get("overrides") or {}).items() if k not in drop}}
                          for a in out["ab_arms"]]
    return out


def wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout_s:.0f} s")


def sweep(config: ServeBenchConfig, load: LoadConfig, prompts: list[Messages], bar: tqdm,
          levels: list[dict] | None = None) -> list[dict]:
    """Every concurrency level against `load.base_url`, appended to `levels` as each one finishes."""
    levels = [] if levels is None else levels
    for c in config.concurrency:
        bar.set_postfix_str(f"C={c}")
        level = summarize_level(run_level_sync(load, prompts, c), load.max_tokens, config.keep_requests)
        levels.append(_with_server_stats(level, load.base_url, is_last=c == config.concurrency[-1]))
        bar.update(1)
    return levels


def _with_server_stats(level: dict, base_url: str, is_last: bool) -> dict:
    """Add the server's overheads (and its stats, timelines only for the last level) when it has them."""
    stats = fetch_server_stats(base_url)
    if stats is not None:
        level["overheads"] = overheads(stats)
        level["server_stats"] = stats if is_last else without_timelines(stats)
    return level


def overheads(stats: dict) -> dict[str, Any]:
    """Per verify worker: transport and exposed draft time per step vs the verify step; scheduler decision time."""
    out: dict[str, Any] = {"workers": {}}
    for wid, w in stats.get("workers", {}).items():
        if "verify_ms_mean" not in w:
            continue
        row = {"verify_ms_mean": w["verify_ms_mean"], "last_k": (w.get("capacity") or {}).get("last_k"),
               "num_fallback_steps": (w.get("capacity") or {}).get("num_fallback_steps")}
        if "transport_ms_mean" in w:
            row.update(transport_ms_mean=w["transport_ms_mean"], draft_wait_ms_mean=w["draft_wait_ms_mean"],
                       transport_frac_of_verify=w["transport_ms_mean"] / max(w["verify_ms_mean"], 1e-9))
        if "push_ms_mean" in w:  # one-way context shipped while not drafting (local cost of posting it)
            row.update(num_pushes=w["num_pushes"], push_ms_mean=w["push_ms_mean"])
        if "transport_ms_per_step" in w:  # the same spread over every step (rounds + pushes)
            row.update(transport_ms_per_step=w["transport_ms_per_step"],
                       transport_per_step_frac_of_verify=w["transport_ms_per_step"] / max(w["verify_ms_mean"], 1e-9))
        out["workers"][wid] = row
    sched = stats.get("scheduler") or {}
    out["scheduler_decision_ms_mean"] = sched.get("decision_ms_mean")
    out["scheduler_decision_ms_p99"] = sched.get("decision_ms_p99")
    return out


def without_timelines(stats: dict) -> dict:
    workers = {wid: {k: v for k, v in w.items() if not k.endswith("timeline")}
               for wid, w in stats.get("workers", {}).items()}
    return {**stats, "workers": workers}


def run_serve_bench(config: ServeBenchConfig) -> dict:
    """Run every arm (and the peer) over every level; returns the JSON-ready result with its summary."""
    validate_arms(config)
    num_prompts = max(config.passes * pass_size(config.load, c) if config.interleave
                      else num_requests_for(config.load, c) for c in config.concurrency) + config.load.num_warmup
    prompts = config.prompts or mixed_chat_prompts(num_prompts, config.datasets, config.max_prompt_chars)
    result: dict[str, Any] = {
        "bench": "serve", "concurrency": list(config.concurrency), "max_tokens": config.load.max_tokens,
        "temperature": config.load.temperature, "seed": config.load.seed, "num_warmup": config.load.num_warmup,
        "waves": config.load.waves, "passes": config.passes if config.interleave else 1,
        "num_requests": {str(c): config.passes * pass_size(config.load, c) if config.interleave else
                         num_requests_for(config.load, c) for c in config.concurrency},
        "num_prompts": len(prompts), "interleave": config.interleave, "base": config.base, "arms": {},
    }
    num_sweeps = len(config.arms) * (1 + (config.alone and config.interleave)) + bool(config.peer_url)
    result["peer_paused_during_our_turns"] = bool(config.peer_url and config.peer_pid)
    with tqdm(total=num_sweeps * len(config.concurrency), desc="bench serve", unit="level") as bar:
        if config.arms:
            result["arms"].update(_run_serve_arms(config, prompts, bar, result))
        if config.peer_url:
            bar.set_description(PEER_ARM)
            load = replace(config.load, base_url=config.peer_url.rstrip("/"), model=config.peer_model)
            result["arms"][PEER_ARM] = {"base_url": load.base_url, "model": config.peer_model,
                                        "levels": sweep(config, load, prompts, bar)}
    result["summary"] = summarize(result)
    if config.alone and config.interleave:
        result["summary"]["fairness"] = fairness_summary(result)
    return result


def _run_serve_arms(config: ServeBenchConfig, prompts: list[Messages], bar: tqdm,
                    result: dict[str, Any]) -> dict[str, dict]:
    import ray
    from ray import serve


    is_ray_ours = not ray.is_initialized()
    if is_ray_ours:
        # interleaved arms are all up at once but only one is loaded at a time: their logical CPU
        # reservations may exceed the cores (torch threads are set per arm, not from num_cpus)
        num_cpus = (os.cpu_count() or 1) + 4 * len(config.arms) if config.interleave else None
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=num_cpus)
    port = config.port or free_port()
    base_url = f"http://{config.host}:{port}"
    try:
        serve.start(http_options={"host": config.host, "port": port})
        if not config.interleave:
            return _run_one_by_one(config, prompts, bar, base_url, "levels")
        if config.peer_url and config.peer_pid:  # the peer's own idle cost, before it is paused
            result["idle_cores_peer_running"] = idle_cores(config.idle_probe_s, {}, config.peer_pid)
        with paused(config.peer_pid):
            arms = _run_interleaved(config, prompts, bar, base_url, result)
            if config.alone:
                for name in list(arms):
                    _delete_app(serve, f"{APP_NAME}-{_route_name(name)}")
                alone = _run_one_by_one(config, prompts, bar, base_url, "alone_levels",
                                        [n for n in arms if not arms[n].get("error")])
                for name, body in alone.items():
                    arms[name]["alone_levels"] = body.get("alone_levels", [])
                    arms[name]["alone_error"] = body.get("error")
        return arms
    finally:
        serve.shutdown()
        if is_ray_ours:
            ray.shutdown()


def _run_one_by_one(config: ServeBenchConfig, prompts: list[Messages], bar: tqdm, base_url: str, key: str,
                    names: list[str] | None = None) -> dict[str, dict]:
    """Each arm deployed alone at "/", swept, deleted; its levels (with the cores used) under `key`."""
    from ray import serve

    from dspark.cluster.app import build_app

    arms: dict[str, dict] = {}
    for name in names if names is not None else list(config.arms):
        bar.set_description(f"{name} alone" if key == "alone_levels" else name)
        args = arm_args(config, name)
        arms[name] = {"config": args, key: []}
        try:
            t0 = time.perf_counter()
            serve.run(build_app(args), name=APP_NAME, route_prefix="/")
            wait_healthy(base_url, config.health_timeout_s)
            arms[name]["startup_s"] = time.perf_counter() - t0
            load = replace(config.load, base_url=base_url)
            titles = {name: f"{APP_NAME}:"}
            for c in config.concurrency:
                bar.set_postfix_str(f"C={c}")
                if config.interleave:  # alone, compared with interleaved: the very same passes, alone
                    level = _passes_alone(config, load, prompts, c, titles)
                else:
                    lv, cores = measure(partial(run_level_sync, replace(load, num_requests=num_requests_for(
                        config.load, c)), prompts, c), titles, config.peer_pid)
                    level = summarize_level(lv, load.max_tokens, config.keep_requests)  # type: ignore[arg-type]
                    level["cores_by_group"] = cores
                arms[name][key].append(_with_server_stats(level, base_url, is_last=c == config.concurrency[-1]))
                bar.update(1)
        except Exception as exc:  # one broken arm must not lose the others' results
            arms[name]["error"] = f"{type(exc).__name__}: {exc}"[:1000] + _deploy_failure(serve, str(exc))
            bar.update(len(config.concurrency) - len(arms[name][key]))
        finally:
            _delete_app(serve)
    return arms


def idle_cores(seconds: float, arm_titles: dict[str, str], peer_pid: int | None) -> dict[str, float]:
    """Cores each process group keeps busy while nothing is sent (idle replicas, heartbeats, metrics)."""
    before = snapshot(arm_titles, peer_pid)
    time.sleep(seconds)
    return cores_used(before, snapshot(arm_titles, peer_pid))


def pass_size(load: LoadConfig, concurrency: int) -> int:
    """Requests per interleaved pass: half the level's (two passes make the level; more passes repeat them on
    further prompts), but at least C (else the level is never reached)."""
    return max(-(-num_requests_for(load, concurrency) // 2), concurrency)


def _passes_alone(config: ServeBenchConfig, load: LoadConfig, prompts: list[Messages], c: int,
                  titles: dict[str, str]) -> dict[str, Any]:
    """One level of an arm deployed alone, run exactly as `_run_interleaved` runs it: `passes` passes of
    `pass_size` requests, pass p on the prompts turned by p. Session 36 found the comparison unfair when the
    alone level was one run of both passes' requests: at C >= 8 that is two requests per client back to back
    (a second wave arriving into the first one's tail) against one per client per pass, and the alone figures
    came out 11-16 % lower with the arm's per-request decode time unchanged."""
    size = pass_size(config.load, c)
    parts, cores = [], []
    for p in range(config.passes):
        part, used = measure(partial(run_level_sync, replace(load, num_requests=size), _rotated(prompts, p, size),
                                     c), titles, config.peer_pid)
        parts.append(part)
        cores.append(used)
    level = _level_of_passes(config, parts, cores)
    level["cores_by_group"] = {g: round(sum(u.get(g, 0.0) for u in cores) / len(cores), 3)
                               for g in sorted({g for u in cores for g in u})}
    return level


def _rotated(prompts: list[Messages], p: int, size: int) -> list[Messages]:
    """Pass p's prompts: the list turned by p passes' worth, so each pass starts further along it."""
    return prompts[p * size:] + prompts[:p * size]


def _level_of_passes(config: ServeBenchConfig, parts: list[LevelResult], cores: list[dict[str, float]]) -> dict:
    """One level's summary from its passes, with each pass's throughput and cores."""
    level = summarize_level(merge_levels(parts), config.load.max_tokens, config.keep_requests)
    level["pass_throughput_tok_s"] = [output_throughput(part) for part in parts]
    level["pass_tps_user_median"] = [summarize_level(part, config.load.max_tokens)["tps_user_median"]
                                     for part in parts]
    level["pass_cores_by_group"] = cores
    return level


def _run_interleaved(config: ServeBenchConfig, prompts: list[Messages], bar: tqdm,
                     base_url: str, result: dict[str, Any]) -> dict[str, dict]:
    """Every arm as its own app (route /<arm>, actors named after the arm), then the passes (A..Z, Z..A, ...);
    each arm's requests paired with the reference arm's (serve_pairs.py)."""
    from ray import serve

    from dspark.cluster.app import build_app

    arms: dict[str, dict] = {}
    urls: dict[str, str] = {}
    for name in config.arms:
        bar.set_description(f"start {name}")
        route = _route_name(name)
        args = {**arm_args(config, name), "cluster_name": f"bench-{route}"}
        arms[name] = {"config": args, "route_prefix": f"/{route}", "levels": []}
        try:
            t0 = time.perf_counter()
            serve.run(build_app(args), name=f"{APP_NAME}-{route}", route_prefix=f"/{route}")
            wait_healthy(f"{base_url}/{route}", config.health_timeout_s)
            arms[name]["startup_s"] = time.perf_counter() - t0
            urls[name] = f"{base_url}/{route}"
        except Exception as exc:  # one broken arm must not lose the others' results
            arms[name]["error"] = (f"{type(exc).__name__}: {exc}"[:1000]
                                   + _deploy_failure(serve, str(exc), f"{APP_NAME}-{route}"))
            bar.update(len(config.concurrency))
    live = list(urls)
    titles = {name: f"{APP_NAME}-{_route_name(name)}:" for name in live}  # `ray::ServeReplica:<app>:...`
    result["idle_cores"] = idle_cores(config.idle_probe_s, titles, config.peer_pid)
    for c in config.concurrency:
        size = pass_size(config.load, c)
        passes: dict[str, list[LevelResult]] = {name: [] for name in live}
        cores: dict[str, list[dict[str, float]]] = {name: [] for name in live}
        for p in range(config.passes):
            for name in live if p % 2 == 0 else live[::-1]:
                bar.set_description(name)
                bar.set_postfix_str(f"C={c} pass {p + 1}/{config.passes}")
                load = replace(config.load, base_url=urls[name], num_requests=size)
                part, used = measure(partial(run_level_sync, load, _rotated(prompts, p, size), c), titles,
                                     config.peer_pid)
                passes[name].append(part)  # type: ignore[arg-type]
                cores[name].append(used)
        for name in live:
            level = _level_of_passes(config, passes[name], cores[name])
            if name != config.reference_arm and config.reference_arm in passes:
                paired = paired_summary(passes[name], passes[config.reference_arm])
                level["tps_user_paired"] = paired and {"reference": config.reference_arm, **paired}
            arms[name]["levels"].append(_with_server_stats(level, urls[name], is_last=c == config.concurrency[-1]))
            bar.update(1)
    return arms


def _route_name(arm: str) -> str:
    route = "".join(ch if ch.isalnum() or ch in "_.-" else "-" for ch in arm)
    if not route.strip("-."):
        raise ValueError(f"arm name {arm!r} has no letters or digits to route by")
    return route


def _deploy_failure(serve: Any, known: str, app_name: str = APP_NAME) -> str:
    """The replicas' own error (Serve keeps it in the app status; the exception only says 'failed')."""
    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # the controller is gone: nothing more to say
        return ""
    if app is None:
        return ""
    messages = [m for m in [app.message, *(d.message for d in app.deployments.values())] if m and m not in known]
    # a traceback's last lines name the cause
    return "".join(f" | {m.strip()[-1500:]}" for m in messages)


def _delete_app(serve: Any, app_name: str = APP_NAME) -> None:
    try:
        serve.delete(app_name)
    except Exception:  # nothing was deployed, or it is already gone
        pass
