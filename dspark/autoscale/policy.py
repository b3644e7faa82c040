"""The autoscaling decision for the verify and draft pools: pure code, no Ray, no clock of its own.

Each pool scales on its own signals:
- verify: tokens per step against the knee of its SPS profile (past the knee a step's time grows
  faster than its tokens), queue depth per replica, TTFT / TPOT p50 against the SLA, and admission's
  pressure: the demand the ingress sees over what the running replicas serve within the SLA (admission
  sheds what they cannot; this signal is how the pool grows before shedding goes on);
- draft: draft-step utilisation and the time verify steps wait for drafts.
Rules, per pool:
- up by the number of replicas the load needs (at least 1) as soon as any signal is over its limit;
  replicas asked for and not yet up count as present, so a slow start is not asked for twice;
- down by one, and only when the N - 1 remaining replicas would hold the load below every limit with
  a margin (consolidation-aware), and only after that has been true for `downscale_delay_s`
  (hysteresis: a burst that drops for a few seconds does not shrink the pool);
- hold when the pool's metrics are older than `stale_after_s` (a scrape or report that stopped must
  not read as "idle").
Every decision, a change or a hold, is returned with its reasons; the caller logs and exports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dspark.spec.sps import SPSTable


@dataclass
class SLA:
    ttft_p50_s: float = 2.0
    tpot_p50_s: float = 0.25  # time per output token after the first
    max_queue_per_replica: float = 4.0  # requests waiting beyond what replicas batch


@dataclass
class PoolLimits:
    min_replicas: int = 1
    max_replicas: int = 4


@dataclass
class PolicyConfig:
    sla: SLA = field(default_factory=SLA)
    verify: PoolLimits = field(default_factory=PoolLimits)
    draft: PoolLimits = field(default_factory=PoolLimits)
    knee_tokens: int = 64  # tokens per step past which the SPS curve bends (see `knee_of`)
    draft_utilisation_high: float = 0.85
    draft_utilisation_low: float = 0.5
    max_draft_wait_ms: float = 10.0  # verify-side wait for drafts per step
    down_margin: float = 0.7  # scale down only if N-1 replicas run at <= 70 % of every limit
    downscale_delay_s: float = 60.0
    stale_after_s: float = 30.0


@dataclass
class VerifySignals:
    num_replicas: int
    tokens_per_step: float  # mean over the window, per replica
    queue_depth: float  # requests waiting, all replicas
    ttft_p50_s: float
    tpot_p50_s: float
    age_s: float = 0.0  # how old the newest report is
    admission_pressure: float = 0.0  # demand / what the running replicas serve within the SLA (ingress)


@dataclass
class DraftSignals:
    num_replicas: int
    utilisation: float  # busy fraction of draft workers, mean
    draft_wait_ms: float  # verify-side wait for drafts per step, mean
    age_s: float = 0.0


@dataclass
class Decision:
    pool: str
    current: int
    target: int
    reasons: list[str]
    is_hold: bool = False

    @property
    def is_change(self) -> bool:
        return self.target != self.current


def knee_of(table: SPSTable, fraction: float = 0.8) -> int:
    """The knee of the SPS curve: the fewest tokens per step B at which a step's throughput B / T(B)
    reaches `fraction` of the best throughput measured. Past it, more tokens per step mostly cost
    latency (each step slows) for little throughput, so a pool running past it needs another replica."""
    rates = [b / t for b, t in zip(table.tokens_per_step, table.step_time_ms)]
    best = max(rates)
    return next(b for b, r in zip(table.tokens_per_step, rates) if r >= fraction * best)


class AutoscalePolicy:
    """Stateful only in the hysteresis clocks; call `decide_*` with the latest signals and the time."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._low_since: dict[str, float | None] = {"verify": None, "draft": None}

    # ---- verify pool -------------------------------------------------------------------------------
    def decide_verify(self, now_s: float, s: VerifySignals, pending: int = 0) -> Decision:
        c, sla = self.config, self.config.sla
        n = s.num_replicas + pending
        if s.age_s > c.stale_after_s:
            return Decision("verify", n, n, [f"hold: metrics {s.age_s:.0f} s old"], is_hold=True)
        # load as a multiple of what one replica holds at each limit: >1 means over it
        pressures = {
            "tokens/step vs knee": s.tokens_per_step * s.num_replicas / c.knee_tokens,
            "queue/replica": s.queue_depth / sla.max_queue_per_replica,
            "ttft p50": s.ttft_p50_s / sla.ttft_p50_s * s.num_replicas,
            "tpot p50": s.tpot_p50_s / sla.tpot_p50_s * s.num_replicas,
            "admission demand vs SLA capacity": s.admission_pressure * s.num_replicas,
        }
        return self._decide("verify", now_s, s.num_replicas, pending, pressures, c.verify)

    # ---- draft pool --------------------------------------------------------------------------------
    def decide_draft(self, now_s: float, s: DraftSignals, pending: int = 0) -> Decision:
        c = self.config
        n = s.num_replicas + pending
        if s.age_s > c.stale_after_s:
            return Decision("draft", n, n, [f"hold: metrics {s.age_s:.0f} s old"], is_hold=True)
        pressures = {
            "draft utilisation": s.utilisation * s.num_replicas / c.draft_utilisation_high,
            "verify draft wait": s.draft_wait_ms / c.max_draft_wait_ms * s.num_replicas,
        }
        return self._decide("draft", now_s, s.num_replicas, pending, pressures, c.draft)

    def _decide(self, pool: str, now_s: float, running: int, pending: int, pressures: dict[str, float],
                limits: PoolLimits) -> Decision:
        """pressures: load in units of 'what one replica may carry'; replicas needed = ceil(max)."""
        c = self.config
        n = running + pending
        per_replica = {k: v / max(running, 1) for k, v in pressures.items()}
        over = [f"{k} {v:.2f}× its limit" for k, v in per_replica.items() if v > 1.0]
        if over:
            self._low_since[pool] = None
            need = math.ceil(max(pressures.values()))
            if pending and need <= n:  # the replicas already asked for cover it once they are up
                return Decision(pool, n, n, [f"waiting for {pending} starting replica(s): " + "; ".join(over)])
            target = min(limits.max_replicas, max(need, n + 1))
            if target > n:
                return Decision(pool, n, target, ["up: " + "; ".join(over)])
            return Decision(pool, n, n, [f"at max_replicas {limits.max_replicas}: " + "; ".join(over)])
        if n <= limits.min_replicas or pending:
            self._low_since[pool] = None
            return Decision(pool, n, n, ["steady"])
        # consolidation: would n - 1 replicas carry it below every limit, with the margin?
        after = {k: v / (n - 1) for k, v in pressures.items()}
        if max(after.values()) <= c.down_margin:
            since = self._low_since[pool]
            if since is None:
                self._low_since[pool] = now_s
                return Decision(pool, n, n, [f"low: {n - 1} would hold it; waiting {c.downscale_delay_s:.0f} s"])
            if now_s - since >= c.downscale_delay_s:
                self._low_since[pool] = None
                worst = max(after, key=after.__getitem__)
                return Decision(pool, n, n - 1, [f"down: {n - 1} replicas hold it ({worst} {after[worst]:.2f}×)"])
            return Decision(pool, n, n, [f"low for {now_s - since:.0f} s of {c.downscale_delay_s:.0f}"])
        self._low_since[pool] = None
        return Decision(pool, n, n, ["steady: fewer replicas would not hold the load"])
