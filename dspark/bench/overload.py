"""`dspark bench overload`: N× the cluster's admission limit, over loopback, new vs static admission in one run.

Starts the app of a serve config on a local Ray cluster; measures its capacity (the static admission
limit's worth of requests at once: their completion rate), then, for each admission mode (`static`: the
fixed limit, capacity + max_queued_requests per arm; `sla`: admission by predicted latency, admission.py),
sends `multiple × limit` streamed chat completions arriving at `multiple ×` that rate, then the same count
in one instant. Reports per phase how many were admitted and completed, how many were refused with 429/503
+ Retry-After, by whom (HAProxy itself or the ingress) and how fast (from the moment the request's bytes
are written to the response's first byte arriving, by the kernel's receive timestamp; when the client read
it is kept beside), any other status, the admitted requests' TTFT and TPOT as the client saw them,
goodput (requests per second completed within the SLA) and SLA attainment, and the resident memory of every
process of the Ray session (sampled throughout, peak per phase) against a stated bound. Afterwards the
engines must hold no request (no leaked KV slot or draft context). `comparison` sets the modes side by side.
The load comes from several processes (load_procs.py), so that one client's event loop is not what limits
a burst. JSON last.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

from dspark.bench.load_procs import LoadProcesses, default_num_procs
from dspark.bench.processes import RssSampler, cpu_used, session_cpu_by_process, session_rss_mb
from dspark.bench.raw_http import request_bytes
from dspark.bench.scrape import counter, draft_links, engine_leftovers
from dspark.bench.serve_bench import fixed_pool_args, free_port, wait_healthy
from dspark.cluster.ingress.admission_gate import MODE_HEADER


def _bodies(num: int, max_tokens: int) -> list[dict]:
    """`num` streamed chat completions (the client measures TTFT and TPOT)."""
    return [{"messages": [{"role": "user", "content": f"Count from {i % 50} to {i % 50 + 9}."}],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "user": f"overload-{i}"}
            for i in range(num)]


def _fire(load: LoadProcesses, base_url: str, num: int, max_tokens: int, headers: dict[str, str],
          timeout_s: float, spread_s: float = 0.0) -> tuple[list[dict], float]:
    """`num` streamed chat completions from the load processes, all at once (`spread_s` 0) or with arrivals
    spread evenly over `spread_s`; their records, and the seconds from the first being sent to the last
    ending."""
    url = urlsplit(base_url)
    recs = load.post_many(url.hostname or "127.0.0.1", url.port or 80, "/v1/chat/completions",
                          _bodies(num, max_tokens), headers, timeout_s, spread_s)
    return recs, time.perf_counter() - load.started_at


async def _open_and_hang_up(host: str, port: int, i: int, max_tokens: int, headers: dict[str, str],
                            timeout_s: float) -> dict:
    """A streaming chat completion that hangs up after its first token arrives (a client gone mid-stream)."""
    req = request_bytes(host, port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": f"Tell a long story about the number {i}."}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "user": f"hangup-{i}"},
        headers)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        writer.write(req)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout_s)
        status = int(status_line.split(b" ", 2)[1])
        seen = b""
        while status == 200 and b'"content"' not in seen:  # a content delta: the request is decoding
            chunk = await asyncio.wait_for(reader.read(4096), timeout_s)
            if not chunk:
                break
            seen += chunk
        writer.transport.abort()  # hang up: no FIN handshake, as a killed client would
        return {"status": status, "hung_up_at": time.monotonic()}
    except (OSError, TimeoutError, ValueError, IndexError) as exc:
        return {"status": None, "error": type(exc).__name__}


async def _hang_up_many(base_url: str, num: int, max_tokens: int, headers: dict[str, str],
                        timeout_s: float) -> list[dict]:
    url = urlsplit(base_url)
    return await asyncio.gather(*(_open_and_hang_up(url.hostname or "127.0.0.1", url.port or 80, i, max_tokens,
                                                    headers, timeout_s) for i in range(num)))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_overload(args: dict[str, Any], multiple: float = 10.0, max_tokens: int = 16,
                 rss_bound_mb: float | None = None, rss_margin_mb: float = 512.0, timeout_s: float = 300.0,
                 headers: dict[str, str] | None = None, burst: bool = True, hangup_max_tokens: int = 1024,
                 repeat: int = 1, modes: tuple[str, ...] = ("static", "sla"), client_procs: int | None = None) -> dict:
    """Phases on one running app: `calibrate` (the static admission limit's worth at once, admitted by the
    static limit: its completion rate is the cluster's capacity); then for each admission mode in `modes`
    (`static`: the old fixed limit; `sla`: by predicted latency), one after the other on the same cluster
    (an admin header picks the mode per request): `<mode>:sustained` (multiple x limit requests arriving
    evenly at multiple x capacity: 10x what the cluster serves, in count and in rate; `repeat` times, so
    memory that levels off shows it is bounded) and, with `burst`, `<mode>:burst` (the same count in one
    instant); then `disconnect` (capacity's worth of long streams whose clients hang up after the first
    token: the engines must hold nothing soon after). Every request is a stream, so the client measures each
    admitted request's TTFT and TPOT; goodput is the requests per second completed within the SLA (args.sla),
    attainment the share of admitted requests within it; `comparison` puts the modes side by side. The load
    comes from `client_procs` processes (load_procs.py; default one per core, at least 2), started before
    the cluster."""
    import ray
    from ray import serve

    from dspark.cluster.app import build_app
    from dspark.config.serve import ServeAppConfig

    # fixed pool sizes: a replica the autoscaler adds mid-run (a model and a KV cache, ~2.7 GB here) would
    # be counted as memory the overload took, and its start-up would stall the cores the run is timing
    args = fixed_pool_args(args)
    if "sla" in modes:  # the SLA arm needs the app's admission built with the SLA; static is asked per request
        args = {**args, "admission": "sla"}
    cfg = ServeAppConfig.model_validate(args)
    sla = {"ttft_s": cfg.sla.ttft_s, "tpot_s": cfg.sla.tpot_s}
    limit = cfg.num_replicas * cfg.admission_limit
    num = int(round(multiple * limit))
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    hdrs = headers or {}
    phases: dict[str, dict] = {}
    records: list[dict] = []
    runs: list[tuple[str, str, float]] = []
    # the metrics agents export every 500 ms (Ray's default: 10 s), so /metrics shows the engines' state soon
    load = LoadProcesses(client_procs or default_num_procs()).__enter__()
    ray.init(include_dashboard=False, log_to_driver=False, _system_config={"metrics_report_interval_ms": 500})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="dspark", route_prefix="/")
        wait_healthy(base_url, 900)
        # warm-up: first-request costs are not in the figures
        _fire(load, base_url, 4, max_tokens, hdrs, timeout_s)
        links_before = draft_links(base_url, hdrs)
        rss_before = session_rss_mb()
        with RssSampler() as rss:
            cpu0 = session_cpu_by_process()
            cal, cal_wall = _fire(load, base_url, limit, max_tokens, {**hdrs, MODE_HEADER: "static"}, timeout_s)
            capacity_rps = sum(1 for r in cal if r["status"] == 200) / cal_wall
            phases["calibrate"] = {**_summary(cal, cal_wall, sla), "capacity_rps": round(capacity_rps, 2),
                                   "cpu_ms_per_request": cpu_used(cpu0, session_cpu_by_process(), len(cal))}
            phases["calibrate"]["rss_peak_mb"] = round(max(rss.samples + [session_rss_mb()]), 1)
            # the bound, stated before the overload starts: full load (the limit's worth in flight) may take
            # what it takes; ten times the load, refused past the limit, may take at most `margin` more
            full_load_peak = phases["calibrate"]["rss_peak_mb"]
            bound = rss_bound_mb if rss_bound_mb is not None else full_load_peak + rss_margin_mb
            spread = num / (multiple * max(capacity_rps, 1e-3))
            for mode in modes:
                runs += ([(mode, "sustained", spread)]
                         + [(mode, f"sustained_{i + 2}", spread) for i in range(repeat - 1)]
                         + ([(mode, "burst", 0.0)] if burst else []))
            for mode, kind, spread_s in runs:
                name = f"{mode}:{kind}"
                mode_hdrs = {**hdrs, MODE_HEADER: mode}
                time.sleep(2.0)  # the previous phase's requests are done; let the engines go idle
                # a few requests in this mode first: the front door learns this mode's limit from their answers
                _fire(load, base_url, 2, max_tokens, mode_hdrs, timeout_s)
                first_sample = len(rss.samples)
                cpu0 = session_cpu_by_process()
                recs, wall = _fire(load, base_url, num, max_tokens, mode_hdrs, timeout_s, spread_s)
                phases[name] = {**_summary(recs, wall, sla), "spread_s": round(spread_s, 2),
                                "arrival_rps": round(num / spread_s, 2) if spread_s else None,
                                "cpu_ms_per_request": cpu_used(cpu0, session_cpu_by_process(), len(recs)),
                                "rss_peak_mb": round(max(rss.samples[first_sample:] + [session_rss_mb()]), 1)}
                records += recs
        links_after = draft_links(base_url, hdrs)
        leftover = engine_leftovers(base_url, hdrs)
        phases["disconnect"] = _disconnect_phase(base_url, hdrs, min(limit, cfg.capacity), hangup_max_tokens,
                                                 timeout_s)
        rss_after = session_rss_mb()
    finally:
        serve.shutdown()
        ray.shutdown()
        load.__exit__()
    everything = cal + records
    names = [f"{m}:{k}" for m, k, _ in runs]
    overload_peak = max(phases[name]["rss_peak_mb"] for name in names)
    sustained = [n for n in names if ":sustained" in n]
    return {
        "bench": "overload", "admission_limit": limit, "multiple": multiple, "max_tokens": max_tokens,
        "sla": sla, "num_sent": len(everything),
        "client": {"num_procs": load.num_procs, "timing": "from the request's bytes written to the response's "
                   "bytes received, kernel receive timestamps (SO_TIMESTAMPNS); *_read_ms: when the load "
                   "process read them"},
        "num_5xx_other_than_503": sum(1 for r in everything if (r["status"] or 0) >= 500 and r["status"] != 503),
        "num_other_than_200_429_503": sum(1 for r in everything if r["status"] not in (200, 429, 503)),
        "num_no_response": sum(1 for r in everything if r["status"] is None),
        "comparison": _comparison(phases, modes),
        "phases": phases,
        "rss_mb": {"before": round(rss_before, 1), "full_load_peak": full_load_peak,
                   "peak": round(max(rss.samples, default=rss_before), 1),
                   "overload_peak": overload_peak, "after": round(rss_after, 1), "bound": round(bound, 1),
                   "within_bound": overload_peak <= bound,
                   "growth_to_peak_by_process": rss.growth_by_process(),
                   # peak of each sustained repetition over the previous one's: levels off when memory is bounded
                   "sustained_peak_growth": [round(phases[b]["rss_peak_mb"] - phases[a]["rss_peak_mb"], 1)
                                             for a, b in zip(sustained, sustained[1:])]},
        "engines_after": leftover,
        # a run whose draft links are down serves target-only and would look fine: say so
        "draft_links": {"before": links_before, "after": links_after},
    }


def _disconnect_phase(base_url: str, hdrs: dict[str, str], num_hangups: int, hangup_max_tokens: int,
                      timeout_s: float) -> dict:
    """Clients that hang up mid-stream: their KV slots and draft contexts must be freed, not decoded to the end."""
    aborted_before = counter(base_url, hdrs, "vllm:request_success_total", 'finished_reason="abort"')
    hung = asyncio.run(_hang_up_many(base_url, num_hangups, hangup_max_tokens, hdrs, timeout_s))
    last = max((r["hung_up_at"] for r in hung if "hung_up_at" in r), default=time.monotonic())
    num_refused_streams = sum(1 for r in hung if r.get("status") in (429, 503))
    # first the aborts must show (the gauges may still read the idle state exported before the streams)
    num_hung = sum(1 for r in hung if "hung_up_at" in r and r["status"] == 200)
    deadline = time.monotonic() + 60.0
    aborted = 0.0
    while time.monotonic() < deadline:
        aborted = counter(base_url, hdrs, "vllm:request_success_total", 'finished_reason="abort"') - aborted_before
        if aborted >= num_hung:
            break
        time.sleep(0.25)
    freed = engine_leftovers(base_url, hdrs, timeout_s=120.0)
    return {"num_streams": num_hangups, "num_hung_up": num_hung, "num_refused": num_refused_streams,
            "max_tokens_each": hangup_max_tokens, "engines_after": freed, "num_recorded_aborted": aborted,
            "freed_within_s": round(time.monotonic() - last, 2) if not any(freed.values()) else None,
            "note": "upper bound: /metrics polled, exported every 0.5 s"}


def _comparison(phases: dict[str, dict], modes: tuple[str, ...]) -> dict:
    """The figures that judge admission, per phase kind, one column per mode."""
    keys = ("goodput_rps", "sla_attainment", "num_admitted_ok", "num_within_sla", "num_refused",
            "num_refused_by_front_door")
    out: dict[str, dict] = {}
    for name, phase in phases.items():
        if ":" not in name:
            continue
        mode, kind = name.split(":", 1)
        row = {k: phase.get(k) for k in keys}
        row["refusal_p99_ms"] = phase["refusal_latency_ms"]["p99"]
        row["admitted_ttft_p99_s"] = phase["admitted_ttft_s"]["p99"]
        row["admitted_tpot_p50_s"] = phase["admitted_tpot_s"]["p50"]
        out.setdefault(kind, {})[mode] = row
    return {kind: {m: by_mode.get(m) for m in modes} for kind, by_mode in out.items()}


def _summary(records: list[dict], wall_s: float, sla: dict[str, float]) -> dict:
    ok = [r for r in records if r["status"] == 200]
    refused = [r for r in records if r["status"] in (429, 503)]
    other = [r for r in records if r["status"] not in (200, 429, 503)]
    # a refusal's latency: to the first byte of the 429/503 arriving at the client's socket (the status line
    # and Retry-After arrive together), by the kernel's receive timestamp; and when the client's loop read it
    refused_s = [r.get("first_byte_s", r["latency_s"]) for r in refused]
    refused_read_s = [r.get("read_first_byte_s", r["latency_s"]) for r in refused]
    connect_s = [r["connect_s"] for r in records if "connect_s" in r]
    refused_end_s = [r["latency_s"] for r in refused]
    ok_s = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if "ttft_s" in r]
    tpot = [r["tpot_s"] for r in ok if "tpot_s" in r]
    within = [r for r in ok if r.get("ttft_s", float("inf")) <= sla["ttft_s"]
              and r.get("tpot_s", 0.0) <= sla["tpot_s"]]
    return {
        "num_sent": len(records), "wall_s": round(wall_s, 3), "num_admitted_ok": len(ok),
        "num_refused": len(refused),
        "num_refused_by_front_door": sum(1 for r in refused if r.get("refused_by") == "front-door"),
        "num_refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
        "num_refused_with_reason": sum(1 for r in refused if r.get("reason")),
        "num_other": len(other), "other_statuses": sorted({str(r["status"]) for r in other}),
        "refusal_reasons": dict(Counter(str(r.get("reason"))[:60] for r in refused).most_common(4)),
        "refusal_latency_ms": {"p50": _ms(_pct(refused_s, 0.5)), "p99": _ms(_pct(refused_s, 0.99)),
                               "max": _ms(max(refused_s) if refused_s else None)},
        "refusal_read_ms": {"p50": _ms(_pct(refused_read_s, 0.5)), "p99": _ms(_pct(refused_read_s, 0.99))},
        "refusal_to_close_ms": {"p50": _ms(_pct(refused_end_s, 0.5)), "p99": _ms(_pct(refused_end_s, 0.99))},
        # asking for the connection to it being up (the client's own sockets and the kernel's handshake)
        "connect_ms": {"p50": _ms(_pct(connect_s, 0.5)), "p99": _ms(_pct(connect_s, 0.99))},
        # when in the phase the slow refusals were sent (a warm-up, a stall, or spread evenly)
        "refusal_p99_ms_by_second": _by_second(refused),
        "admitted_latency_s": {"p50": _pct(ok_s, 0.5), "p99": _pct(ok_s, 0.99), "max": max(ok_s) if ok_s else None,
                               "mean": statistics.fmean(ok_s) if ok_s else None},
        "admitted_ttft_s": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)},
        "admitted_tpot_s": {"p50": _pct(tpot, 0.5), "p99": _pct(tpot, 0.99)},
        # goodput: requests per second completed within the SLA (TTFT and TPOT), over the phase's wall time
        "num_within_sla": len(within), "goodput_rps": round(len(within) / max(wall_s, 1e-9), 3),
        "sla_attainment": round(len(within) / len(ok), 3) if ok else None,
    }


def _by_second(records: list[dict]) -> list[float | None]:
    """p99 latency (ms) of the records sent in each second of the phase, in order."""
    if not records:
        return []
    start = min(r["sent_at"] for r in records)
    buckets: dict[int, list[float]] = {}
    for r in records:
        buckets.setdefault(int(r["sent_at"] - start), []).append(r.get("first_byte_s", r["latency_s"]))
    return [_ms(_pct(buckets.get(i, []), 0.99)) for i in range(max(buckets) + 1)]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1e3 * value, 2)


