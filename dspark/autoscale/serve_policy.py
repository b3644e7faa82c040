"""The Serve adapter of the pools' autoscaling policy: Ray 2.60's application-level `autoscaling_policy`.

In the serve YAML, under the application:

    autoscaling_policy:
      policy_function: dspark.autoscale.serve_policy:PoolAutoscaler
      policy_kwargs: {knee_tokens: 64, downscale_delay_s: 60}

Serve instantiates `PoolAutoscaler(**policy_kwargs)` once, in its controller, and calls it every tick with
the context of every deployment that has an `autoscaling_config` (their min/max bounds still apply).
For each arm it reads the verify deployment `<arm>-verify` and the draft deployment `<arm>-draft`: their
replicas' `record_autoscaling_stats` (serve_pools.py), aggregated by Serve over `look_back_period_s`, become
the signals of `policy.py`, which decides each pool on its own signals. A draft replica drafts for up to
`max_verify_per_draft` verify replicas (M:N; the same number as in the app's args), so the draft pool's
own answer is kept within [ceil(V / m), V] of the verify pool's target V.

The SLA is not a policy argument: it is set once, in the app's `args.sla`, where admission reads it, and
each verify replica reports the one its arm serves under (`sla_ttft_s`, `sla_tpot_s`). The ingress
(`SpecDecodeServer`, given an autoscaling range of one size so that it is in this policy's view) reports
each arm's admission pressure, `admission_pressure:<arm>`: demand over what the arm's running replicas serve
within the SLA. Over 1 the verify pool grows; admission sheds only what the running replicas cannot serve
while the new ones start, and its limit grows with them. Every decision is
logged (controller log) and exported: `dspark_autoscale_decisions_total{pool,direction}`,
`dspark_autoscale_target_replicas{pool}`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from dspark.autoscale.policy import SLA, AutoscalePolicy, DraftSignals, PolicyConfig, PoolLimits, VerifySignals
from dspark.metrics.series import Metrics

PRESSURE_PREFIX = "admission_pressure:"

log = logging.getLogger("ray.serve")


def _mean(values: dict) -> float:
    return sum(values.values()) / len(values) if values else 0.0


def _age_s(ctx: Any, now_s: float) -> float:
    """Age of the newest custom metric sample of a deployment (a deployment with none is fresh: 0)."""
    newest = [ts[-1].timestamp for series in (ctx.raw_metrics or {}).values() for ts in series.values() if ts]
    return max(0.0, now_s - max(newest)) if newest else 0.0


class PoolAutoscaler:
    def __init__(self, knee_tokens: int = 64, max_queue_per_replica: float = 4.0, draft_utilisation_high: float = 0.85,
                 max_draft_wait_ms: float = 10.0, down_margin: float = 0.7, downscale_delay_s: float = 60.0,
                 stale_after_s: float = 30.0, max_verify_per_draft: int = 1, ttft_p50_s: float | None = None,
                 tpot_p50_s: float | None = None) -> None:
        if ttft_p50_s is not None or tpot_p50_s is not None:
            raise ValueError("policy_kwargs ttft_p50_s / tpot_p50_s: the SLA is set once, in the app's args "
                             "(`sla: {ttft_s: ..., tpot_s: ...}`), read by admission and reported to this policy "
                             "by the verify pools; remove them from policy_kwargs")
        self.max_verify_per_draft = max(1, int(max_verify_per_draft))
        self.config = PolicyConfig(
            # the SLA's TTFT / TPOT come from the verify pools' reports (args.sla); none reported: not a signal
            sla=SLA(ttft_p50_s=float("inf"), tpot_p50_s=float("inf"), max_queue_per_replica=max_queue_per_replica),
            verify=PoolLimits(1, 1 << 20), draft=PoolLimits(1, 1 << 20), knee_tokens=knee_tokens,
            draft_utilisation_high=draft_utilisation_high, max_draft_wait_ms=max_draft_wait_ms,
            down_margin=down_margin, downscale_delay_s=downscale_delay_s, stale_after_s=stale_after_s)
        self.policies: dict[str, AutoscalePolicy] = {}  # per arm: its own hysteresis clocks
        self.metrics: dict[str, Metrics] = {}
        self.last: dict[str, dict] = {}

    def __call__(self, ctxs: dict) -> tuple[dict, dict]:
        now_s = time.time()
        arms: dict[str, dict[str, Any]] = {}
        pressure: dict[str, float] = {}  # per arm, from the ingress replicas (their mean)
        for dep_id, ctx in ctxs.items():
            arm, _, pool = dep_id.name.rpartition("-")
            if pool in ("verify", "draft") and arm:
                arms.setdefault(arm, {})[pool] = (dep_id, ctx)
            for name, by_replica in (ctx.aggregated_metrics or {}).items():
                if name.startswith(PRESSURE_PREFIX) and by_replica:
                    pressure[name[len(PRESSURE_PREFIX):]] = _mean(by_replica)
        decisions: dict = {}
        state: dict = {}
        for arm, pools in arms.items():
            policy = self.policies.setdefault(arm, AutoscalePolicy(dataclasses.replace(self.config)))
            verify_target = None
            if "verify" in pools:
                dep_id, ctx = pools["verify"]
                policy.config.sla = self._sla(ctx, policy.config.sla)
                signals = self._verify_signals(ctx, now_s)
                signals.admission_pressure = pressure.get(arm, 0.0)
                d = policy.decide_verify(now_s, signals, self._pending(ctx))
                _clamp(d, ctx)
                decisions[dep_id] = verify_target = d.target
                state[dep_id] = self._record(arm, d)
            if "draft" in pools:
                dep_id, ctx = pools["draft"]
                vctx = pools["verify"][1] if "verify" in pools else None
                d = policy.decide_draft(now_s, self._draft_signals(ctx, vctx, now_s), self._pending(ctx))
                if verify_target is not None:
                    # a draft replica drafts for up to max_verify_per_draft verify replicas: fewer than
                    # ceil(V / m) leaves verify replicas target-only, more than V would sit unpaired
                    low, high = -(-verify_target // self.max_verify_per_draft), verify_target
                    bounded = min(high, max(low, d.target))
                    if bounded != d.target:
                        d.reasons.append(f"bounded to [{low}, {high}] by the verify pool's {verify_target} "
                                         f"(up to {self.max_verify_per_draft} per draft replica)")
                        d.target = bounded
                _clamp(d, ctx)
                decisions[dep_id] = d.target
                state[dep_id] = self._record(arm, d)
        return decisions, state

    @staticmethod
    def _sla(ctx: Any, sla: SLA) -> SLA:
        """The SLA the arm's verify replicas report (args.sla), else the one held."""
        m = ctx.aggregated_metrics or {}
        ttft, tpot = _mean(m.get("sla_ttft_s", {})), _mean(m.get("sla_tpot_s", {}))
        if ttft > 0 and tpot > 0:
            return SLA(ttft_p50_s=ttft, tpot_p50_s=tpot, max_queue_per_replica=sla.max_queue_per_replica)
        return sla

    @staticmethod
    def _pending(ctx: Any) -> int:
        """Replicas asked for and not running yet (the policy counts them as present)."""
        return max(0, int(ctx.target_num_replicas) - int(ctx.current_num_replicas))

    @staticmethod
    def _verify_signals(ctx: Any, now_s: float) -> VerifySignals:
        m = ctx.aggregated_metrics or {}
        return VerifySignals(num_replicas=int(ctx.current_num_replicas),
                             tokens_per_step=_mean(m.get("tokens_per_step", {})),
                             queue_depth=sum(m.get("queue_depth", {}).values()),
                             ttft_p50_s=_mean(m.get("ttft_p50_s", {})), tpot_p50_s=_mean(m.get("tpot_p50_s", {})),
                             age_s=_age_s(ctx, now_s))

    @staticmethod
    def _draft_signals(ctx: Any, verify_ctx: Any | None, now_s: float) -> DraftSignals:
        m = ctx.aggregated_metrics or {}
        wait = _mean((verify_ctx.aggregated_metrics or {}).get("draft_wait_ms", {})) if verify_ctx else 0.0
        return DraftSignals(num_replicas=int(ctx.current_num_replicas),
                            utilisation=_mean(m.get("utilisation", {})), draft_wait_ms=wait, age_s=_age_s(ctx, now_s))

    def _record(self, arm: str, d: Any) -> dict:
        m = self.metrics.setdefault(arm, Metrics("", arm, "autoscaler", "controller"))
        direction = "up" if d.target > d.current else "down" if d.target < d.current else "hold"
        m.inc("dspark_autoscale_decisions_total", 1.0, direction=direction, target_pool=d.pool)
        m.set("dspark_autoscale_target_replicas", d.target, target_pool=d.pool)
        key = f"{arm}-{d.pool}"
        summary = {"current": d.current, "target": d.target, "reasons": list(d.reasons)}
        before = self.last.get(key)
        # every change is logged; a hold only when it differs from the last decision's counts (ticks are ~0.1 s)
        if before is None or (before["current"], before["target"]) != (d.current, d.target):
            log.info("dspark autoscale %s: %d -> %d (%s)", key, d.current, d.target, "; ".join(d.reasons))
        self.last[key] = summary
        return {"last_decision": summary}


def _clamp(d: Any, ctx: Any) -> None:
    """Within the deployment's own autoscaling bounds (Serve clamps as well; the draft pool's bounds are
    derived from the verify pool's target, so that must be what Serve will really run)."""
    low = int(getattr(ctx, "capacity_adjusted_min_replicas", 1))
    high = int(getattr(ctx, "capacity_adjusted_max_replicas", 1 << 20))
    bounded = min(high, max(low, d.target))
    if bounded != d.target:
        d.reasons.append(f"held within the pool's bounds [{low}, {high}]")
        d.target = bounded
