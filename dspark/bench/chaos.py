"""`dspark bench chaos`: kill -9 workers of a running cluster under bounded load, one fault at a time.

One cluster (decoupled pools, 2 verify + 2 draft workers by default) serves a fixed set of greedy requests
once without faults (the reference outputs and throughput), then once per scenario while a SIGKILL hits
the scenario's processes mid-stream: `draft` (a draft worker), `verify` (a verify worker), `scheduler`
(the SchedulerActor), `draft+verify` (a draft worker and the other pair's verify worker together). Per
scenario: requests that failed (expected 0), outputs that differ from the reference (expected 0), the
wall time of the faulty run against the reference, how long until the cluster is whole again (dead
workers back and re-paired), and what the engines still hold afterwards (KV slots, draft contexts).
JSON last.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
from typing import Any

import httpx

from dspark.bench.serve_bench import fixed_pool_args, free_port, wait_healthy

SCENARIOS = {"draft": ("draft-1",), "verify": ("verify-0",), "scheduler": ("scheduler",),
             "draft+verify": ("draft-0", "verify-1")}


def _complete(client: httpx.Client, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    try:
        resp = client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return {"ok": False, "error": type(exc).__name__}
    if resp.status_code != 200:
        return {"ok": False, "error": f"HTTP {resp.status_code}"}
    if not stream:
        return {"ok": True, "text": resp.json()["choices"][0]["text"]}
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    if any("error" in e for e in events):
        return {"ok": False, "error": "in-stream error"}
    return {"ok": True, "text": "".join(e["choices"][0]["text"] for e in events)}


def _run(client: httpx.Client, prompts: list[str], max_tokens: int, victims: list[int] | None = None,
         kill_after_s: float = 0.0, min_repairs: int = 0, recover_timeout_s: float = 300.0,
         sizes: dict[str, int] | None = None) -> tuple[list[dict], float, float | None, dict]:
    """The requests at once; with `victims`, SIGKILL them after `kill_after_s` and time, from the kill,
    until the cluster is whole again (polled while the requests still run)."""
    t0 = time.perf_counter()
    recover_s, stats = None, {}
    with cf.ThreadPoolExecutor(len(prompts) + 1) as pool:
        futures = [pool.submit(_complete, client, p, max_tokens, i % 2 == 0) for i, p in enumerate(prompts)]
        if victims:
            time.sleep(kill_after_s)
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            watch = pool.submit(_recovered, client, min_repairs, recover_timeout_s, sizes, tuple(victims))
        results = [f.result() for f in futures]
        if victims:
            recover_s, stats = watch.result()
    return results, time.perf_counter() - t0, recover_s, stats


def _pids(client: httpx.Client, cluster: str, names: tuple[str, ...]) -> list[int]:
    """Process ids of the named victims: `<pool>-<i>` is the i-th worker of the pool (named actors), or the
    i-th live replica in id order (Serve pools); `scheduler` the SchedulerActor."""
    import ray

    from dspark.cluster.pools.actor_pools import ACTOR_NAMESPACE

    stats = client.get("/v1/dspark/stats").json()
    pids = []
    for n in names:
        if stats.get("pools") == "serve" and n != "scheduler":
            pool, _, index = n.rpartition("-")
            replicas = _live_replicas(stats)[pool]
            pids.append(replicas[sorted(replicas)[int(index)]]["pid"])
        else:
            pids.append(ray.get(ray.get_actor(f"{cluster}-{n}", namespace=ACTOR_NAMESPACE).pid.remote(), timeout=30))
    return pids


def _live_replicas(stats: dict, max_age_s: float = 5.0) -> dict[str, dict]:
    reps = (stats.get("scheduler") or {}).get("replicas") or {}
    return {pool: {r: v for r, v in reps.get(pool, {}).items() if v["age_s"] <= max_age_s}
            for pool in ("verify", "draft")}


def _serve_whole(stats: dict, sizes: dict[str, int], dead_pids: tuple[int, ...] = ()) -> bool:
    """Serve pools: as many live replicas as before (the killed ones replaced), every verify replica drafting
    with a partner."""
    live = {p: {r: v for r, v in reps.items() if v.get("pid") not in dead_pids}
            for p, reps in _live_replicas(stats).items()}
    return (all(len(live[p]) == n for p, n in sizes.items()) and "error" not in stats["scheduler"]
            and all(not v.get("draft_broken") for v in live["verify"].values()))


def _recovered(client: httpx.Client, min_repairs: int, timeout_s: float, sizes: dict[str, int] | None = None,
               dead_pids: tuple[int, ...] = ()) -> tuple[float | None, dict]:
    t0 = time.perf_counter()
    stats: dict = {}
    time.sleep(0.5)  # let the kill be noticed first
    while time.perf_counter() - t0 < timeout_s:
        try:
            stats = client.get("/v1/dspark/stats", timeout=30).json()
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        if stats.get("pools") == "serve":
            if _serve_whole(stats, sizes or {}, dead_pids):
                return time.perf_counter() - t0, stats
            time.sleep(0.5)
            continue
        workers = stats["workers"].values()
        healthy = (not stats["down"] and all(w.get("error") is None for w in workers)
                   and all(w.get("draft_channel_error") is None for w in workers if "draft_worker" in w)
                   and "error" not in (stats.get("scheduler") or {}) and stats["num_repairs"] >= min_repairs)
        if healthy:
            return time.perf_counter() - t0, stats
        time.sleep(0.5)
    return None, stats


def _held(stats: dict) -> dict[str, int]:
    out = {"kv_slots": 0, "waiting": 0, "draft_contexts": 0}
    if stats.get("pools") == "serve":
        live = _live_replicas(stats)
        out["kv_slots"] = sum(v.get("num_running", 0) for v in live["verify"].values())
        out["waiting"] = sum(v.get("num_waiting", 0) for v in live["verify"].values())
        out["draft_contexts"] = sum(v.get("num_contexts", 0) for v in live["draft"].values())
        return out
    for w in stats["workers"].values():
        if "num_running" in w:
            out["kv_slots"] += w["num_running"]
            out["waiting"] += w["num_waiting"]
        elif "num_requests" in w:
            out["draft_contexts"] += w["num_requests"]
    return out


def _wait_whole(client: httpx.Client, sizes: dict[str, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _serve_whole(client.get("/v1/dspark/stats").json(), sizes):
            return
        time.sleep(0.5)
    raise TimeoutError("the Serve pools did not come up whole")


def run_chaos(args: dict[str, Any], prompts: list[str], max_tokens: int = 64, scenarios: list[str] | None = None,
              kill_after_s: float = 1.0, recover_timeout_s: float = 300.0) -> dict:
    import ray
    from ray import serve

    from dspark.cluster.app import build_app

    args = {"mode": "decoupled", "scheduler": "central", "num_verify_workers": 2, "num_draft_workers": 2,
            "cluster_name": "dspark-chaos", **args}
    # fixed pool sizes: a fault must be healed by replacement, not hidden by an autoscaler's choice
    args = fixed_pool_args(args)
    args.update(num_verify_workers=max(2, args["num_verify_workers"]),
                num_draft_workers=max(2, args["num_draft_workers"]))
    cluster = args["cluster_name"]
    chosen = scenarios or list(SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; expected {list(SCENARIOS)}")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    is_ray_ours = not ray.is_initialized()
    if is_ray_ours:
        ray.init(include_dashboard=False, log_to_driver=False)
    result: dict[str, Any] = {"bench": "chaos", "num_requests": len(prompts), "max_tokens": max_tokens,
                              "kill_after_s": kill_after_s, "config": args, "scenarios": {}}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="dspark-chaos", route_prefix="/")
        wait_healthy(base_url, 900)
        with httpx.Client(base_url=base_url, timeout=600) as client:
            _run(client, prompts[:2], 8)  # warm-up
            reference, ref_s, _, _ = _run(client, prompts, max_tokens)
            if not all(r["ok"] for r in reference):
                raise RuntimeError(f"the fault-free run failed: {[r for r in reference if not r['ok']]}")
            result["reference_wall_s"] = round(ref_s, 3)
            sizes = {"verify": args["num_verify_workers"], "draft": args["num_draft_workers"]}
            if args.get("pools") == "serve":
                _wait_whole(client, sizes, recover_timeout_s)
            for name in chosen:
                repairs = client.get("/v1/dspark/stats").json().get("num_repairs", 0)
                need = sum(1 for v in SCENARIOS[name] if v.startswith(("draft", "verify")))
                victims = _pids(client, cluster, SCENARIOS[name])
                results, wall_s, recover_s, stats = _run(client, prompts, max_tokens, victims, kill_after_s,
                                                         repairs + need, recover_timeout_s, sizes)
                time.sleep(3.0)  # idle engines announce finished requests; Serve replicas' heartbeats catch up
                stats = client.get("/v1/dspark/stats").json()
                verify_live = _live_replicas(stats)["verify"].values()
                result["scenarios"][name] = {
                    "killed": [f"{cluster}-{v}" for v in SCENARIOS[name]],
                    "num_failed": sum(not r["ok"] for r in results),
                    "errors": sorted({r["error"] for r in results if not r["ok"]}),
                    "num_outputs_differing": sum(r["ok"] and r["text"] != ref["text"]
                                                 for r, ref in zip(results, reference)),
                    "wall_s": round(wall_s, 3), "wall_over_reference": round(wall_s / ref_s, 3),
                    "recovered_s_after_kill": None if recover_s is None else round(recover_s, 2),
                    "num_resumed_total": stats.get("num_resumed"), "num_repairs_total": stats.get("num_repairs"),
                    "held_after": _held(stats),
                    # context positions the surviving verify replicas recomputed for their new draft partners
                    "contexts_rebuilt_total": sum(v.get("contexts_rebuilt", 0) for v in verify_live),
                    "rebuild_ms_total": round(sum(v.get("rebuild_ms", 0.0) for v in verify_live), 1)}
    finally:
        serve.shutdown()
        if is_ray_ours:
            ray.shutdown()
    s = result["scenarios"].values()
    result["summary"] = {"requests_lost": sum(v["num_failed"] for v in s),
                         "outputs_differing": sum(v["num_outputs_differing"] for v in s),
                         "all_recovered": all(v["recovered_s_after_kill"] is not None for v in s),
                         "held_after": {k: sum(v["held_after"][k] for v in s) for k in ("kv_slots", "draft_contexts")}}
    return result
