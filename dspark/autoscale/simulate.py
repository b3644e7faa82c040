"""Replay a traffic trace through the REAL autoscaling policy without a cluster, to judge and tune it.

A fluid model of the pools, one tick per second:
- requests arrive at the trace's rate (deterministic thinning of a seeded Poisson process) and go to the
  running verify replica with the most free slots, else into a queue;
- a verify replica with n requests runs steps of B = n × (1 + ℓ) tokens whose time T(B) comes from a
  measured SPS profile; each step gives every request τ tokens; a request ends after `output_tokens`;
- draft work is `draft_ms_per_request` per request per step; its utilisation is that demand over the
  draft replicas' time, and past `draft_saturation` the verify steps wait for drafts;
- replicas take `startup_s` to come up; a replica scaled away drains (takes no new requests, leaves
  when empty), so no request is lost by construction: the count of lost requests is reported anyway.
Every `interval_s` the policy gets the window's signals (means, p50s) and its decision is applied.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from dspark.autoscale.policy import AutoscalePolicy, Decision, DraftSignals, PolicyConfig, VerifySignals
from dspark.spec.sps import SPSTable

# (duration s, arrivals per second) segments; one replica of SmolLM2 at 32 sequences in bf16 on the
# 2-core AMX Xeon completes ~15 requests of 64 tokens a second (τ 1.8)
TRACES: dict[str, list[tuple[float, float]]] = {
    "rising": [(120, 3.0), (120, 10.0), (120, 20.0), (120, 34.0)],
    "bursty": [(90, 5.0), (30, 36.0), (120, 5.0), (30, 36.0), (120, 5.0)],
    "falling": [(120, 34.0), (120, 18.0), (120, 8.0), (240, 1.0)],
}


@dataclass
class SimConfig:
    output_tokens: int = 64
    max_num_seqs: int = 32
    verify_len: float = 2.0  # ℓ: draft tokens verified per request and step
    tau: float = 1.8  # tokens a request gains per step
    draft_ms_per_request: float = 1.5
    draft_saturation: float = 0.9
    startup_s: float = 20.0
    interval_s: float = 5.0
    stale_windows: list[tuple[float, float]] = field(default_factory=list)  # (from s, to s): no reports
    seed: int = 0


@dataclass
class _Replica:
    active: list[list[float]] = field(default_factory=list)  # [arrival s, first token s or -1, tokens]
    ready_at: float = 0.0
    is_draining: bool = False


def simulate(trace: list[tuple[float, float]], sps: SPSTable, policy_config: PolicyConfig,
             sim: SimConfig | None = None) -> dict:
    sim = sim or SimConfig()
    policy = AutoscalePolicy(policy_config)
    rng = random.Random(sim.seed)
    verify = [_Replica() for _ in range(policy_config.verify.min_replicas)]
    num_draft, draft_pending_until = policy_config.draft.min_replicas, []
    queue: list[float] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    window: dict[str, list[float]] = {"tokens": [], "util": [], "wait": []}
    timeline, decisions = [], []
    done = lost = 0
    last_report = 0.0
    t, horizon = 0.0, sum(d for d, _ in trace)
    while t < horizon:
        rate = _rate_at(trace, t)
        arrivals = _poisson(rng, rate)
        queue += [t] * arrivals
        ready = [r for r in verify if r.ready_at <= t and not r.is_draining]
        for _ in range(len(queue)):
            free = [r for r in ready if len(r.active) < sim.max_num_seqs]
            if not free:
                break
            max(free, key=lambda r: sim.max_num_seqs - len(r.active)).active.append([queue.pop(0), -1.0, 0.0])
        running_draft = num_draft + sum(1 for u in draft_pending_until if u <= t)
        draft_pending_until = [u for u in draft_pending_until if u > t]
        num_draft = running_draft
        steps_by_replica = []
        for r in verify:
            if r.ready_at > t or not r.active:
                steps_by_replica.append((r, 0.0, 0.0))
                continue
            tokens = len(r.active) * (1 + sim.verify_len)
            steps_by_replica.append((r, tokens, sps.step_time_ms_at(max(1, round(tokens)))))
        demand_ms = sum(len(r.active) * sim.draft_ms_per_request * 1000.0 / step_ms
                        for r, _, step_ms in steps_by_replica if step_ms)
        util = demand_ms / (1000.0 * max(num_draft, 1))
        wait_ms = sim.draft_ms_per_request * 10 * max(0.0, util - sim.draft_saturation) / (1 - sim.draft_saturation)
        for r, tokens, step_ms in steps_by_replica:
            if not step_ms:
                continue
            step_ms += wait_ms
            steps = 1000.0 / step_ms
            window["tokens"].append(tokens)
            for req in r.active:
                if req[1] < 0:
                    req[1] = t + step_ms / 1000.0
                    ttfts.append(req[1] - req[0])
                req[2] += sim.tau * steps
            tpots.append(step_ms / 1000.0 / sim.tau)
            finished = [q for q in r.active if q[2] >= sim.output_tokens]
            done += len(finished)
            r.active = [q for q in r.active if q[2] < sim.output_tokens]
        lost += sum(len(r.active) for r in verify if r.is_draining and not r.active)  # 0: only empty ones go
        verify = [r for r in verify if not (r.is_draining and not r.active)]  # drained replicas leave
        window["util"].append(util)
        window["wait"].append(wait_ms)
        t += 1.0
        if t - last_report >= sim.interval_s:
            is_stale = any(a <= t < b for a, b in sim.stale_windows)
            age = t - last_report if is_stale else 0.0
            if not is_stale:
                last_report = t
            n_verify = sum(1 for r in verify if r.ready_at <= t and not r.is_draining)
            pending = sum(1 for r in verify if r.ready_at > t)
            recent_ttft, recent_tpot = ttfts[-50:], tpots[-50:]
            vs = VerifySignals(max(n_verify, 1), _mean(window["tokens"]), len(queue),
                               statistics.median(recent_ttft) if recent_ttft else 0.0,
                               statistics.median(recent_tpot) if recent_tpot else 0.0,
                               age_s=age if is_stale else 0.0)
            ds = DraftSignals(max(num_draft, 1), _mean(window["util"]), _mean(window["wait"]),
                              age_s=age if is_stale else 0.0)
            for d in (policy.decide_verify(t, vs, pending), policy.decide_draft(t, ds, len(draft_pending_until))):
                decisions.append({"t_s": t, **_decision_dict(d)})
                if d.pool == "verify" and d.is_change:
                    _apply_verify(verify, d, t, sim.startup_s)
                elif d.pool == "draft" and d.is_change:
                    if d.target > d.current:
                        draft_pending_until += [t + sim.startup_s / 2] * (d.target - d.current)
                    else:
                        num_draft = max(policy_config.draft.min_replicas, num_draft - (d.current - d.target))
            window = {"tokens": [], "util": [], "wait": []}
        sla = policy_config.sla
        p50_ttft = statistics.median(ttfts[-50:]) if ttfts else 0.0
        p50_tpot = statistics.median(tpots[-50:]) if tpots else 0.0
        timeline.append({"t_s": t, "rate": rate, "queue": len(queue),
                         "verify_replicas": sum(1 for r in verify if r.ready_at <= t),
                         "verify_pending": sum(1 for r in verify if r.ready_at > t),
                         "draft_replicas": num_draft, "draft_utilisation": round(util, 3),
                         "ttft_p50_s": round(p50_ttft, 3), "tpot_p50_s": round(p50_tpot, 4),
                         "sla_violated": p50_ttft > sla.ttft_p50_s or p50_tpot > sla.tpot_p50_s})
    return {
        "num_completed": done, "num_lost": lost, "num_waiting_at_end": len(queue),
        "verify_replica_minutes": round(sum(p["verify_replicas"] for p in timeline) / 60, 2),
        "draft_replica_minutes": round(sum(p["draft_replicas"] for p in timeline) / 60, 2),
        "sla_violation_fraction": round(sum(p["sla_violated"] for p in timeline) / max(len(timeline), 1), 3),
        "num_scale_events": sum(1 for d in decisions if d["target"] != d["current"]),
        "num_holds": sum(1 for d in decisions if d["is_hold"]),
        "decisions": [d for d in decisions if d["target"] != d["current"] or d["is_hold"]],
        "timeline": timeline,
    }


def _apply_verify(verify: list[_Replica], d: Decision, t: float, startup_s: float) -> None:
    if d.target > d.current:
        verify += [_Replica(ready_at=t + startup_s) for _ in range(d.target - d.current)]
        return
    # scale down: the least loaded running replica drains (no new requests; leaves when empty)
    running = [r for r in verify if r.ready_at <= t and not r.is_draining]
    for r in sorted(running, key=lambda r: len(r.active))[:d.current - d.target]:
        r.is_draining = True


def _decision_dict(d: Decision) -> dict:
    return {"pool": d.pool, "current": d.current, "target": d.target, "is_hold": d.is_hold, "reasons": d.reasons}


def _rate_at(trace: list[tuple[float, float]], t: float) -> float:
    for duration, rate in trace:
        if t < duration:
            return rate
        t -= duration
    return trace[-1][1]


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: small means only (arrivals per second)
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
