"""The ingress's door: per-arm admission (admission.py), per-key quotas (quotas.py), what the front door is told.

One object per ingress replica, used by the HTTP layer (guard.py, routes.py) at three points: before the body is
read (`precheck`: a key over its quota, or every arm at its limit, is refused there), when the request's arm
is known (`enter`), and on every response of the generate routes (`published_headers`: the limit and the
wait the front door refuses by, front_door_rules.py). It counts its decisions
(`dspark_admission_decisions_total{decision}`) and its refusals by reason
(`dspark_admission_refused_total{reason}`: ttft, tpot, unmeasured, full, quota), exports each arm's limit,
the verify replicas it counts and its pressure as gauges, and logs (logger `ray.serve`, so in the replica's
Serve log) every change of an arm's limit or replicas and when an arm starts and stops shedding, with the
numbers that decided it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from dspark.cluster.ingress.admission import Admission, Mode
from dspark.cluster.ingress.quotas import QuotaBook, QuotaDecision
from dspark.metrics.series import Metrics

log = logging.getLogger("ray.serve")  # Serve's replica log (a module logger's INFO goes nowhere in a replica)
LIMIT_LOG_INTERVAL_S = 1.0  # a changed limit is logged at most this often per arm (replica changes at once)

LIMIT_HEADER = "x-dspark-admit-limit"
RETRY_HEADER = "x-dspark-retry-after"
MODE_HEADER = "x-dspark-admission"  # admin keys only: `static` or `sla` for this request (benchmarks)


@dataclass
class Refusal:
    status: int
    message: str
    type_: str
    code: str
    headers: dict[str, str]


class AdmissionGate:
    def __init__(self, admissions: dict[str, Admission], quotas: QuotaBook | None = None,
                 metrics: dict[str, Metrics] | None = None) -> None:
        self.admissions = admissions
        self.quotas = quotas
        self.metrics = metrics or {}
        self._is_shedding = dict.fromkeys(admissions, False)
        self._shed_since: dict[str, float] = {}
        self._logged: dict[str, tuple[int, int, float]] = {}  # arm -> (limit, replicas, when) last logged
        for arm, m in self.metrics.items():
            if arm in admissions:
                m.refresh_every(lambda arm=arm, m=m: self._gauges(arm, m), interval_s=2.0)

    # ---- before the body -------------------------------------------------------------------------
    def precheck(self, digest: str | None, mode: Mode | None) -> tuple[Refusal | None, dict[str, str]]:
        """A quota refusal, or every arm at its limit (whichever arm the request gets, it would be refused);
        and the rate-limit headers for every response to it (empty for keys without a quota), which the
        caller adds, to a refusal too."""
        decision: QuotaDecision | None = self.quotas.check(digest) if self.quotas else None
        quota_headers = decision.headers if decision else {}
        if decision is not None and not decision.is_allowed:
            self._count(None, "quota", "quota")
            return Refusal(429, f"rate limit reached for this API key ({decision.reason}); retry later",
                           "rate_limit_error", "rate_limit_exceeded",
                           {"Retry-After": str(decision.retry_after_s)}), quota_headers
        if self.admissions and all(a.num_in_flight >= a.current_limit(mode) for a in self.admissions.values()):
            for arm, a in self.admissions.items():  # each arm would have refused it: each counts it
                a.try_enter(mode)
                self._count(arm, "shed" if a.num_in_flight < a.hard_limit else "full", a.refusal_reason(mode))
                self._note_shedding(arm, a)
            return Refusal(429, "the server is at capacity; retry later", "rate_limit_error", "overloaded",
                           {"Retry-After": str(self.retry_after_s(mode))}), quota_headers
        return None, quota_headers

    # ---- once the arm is known -------------------------------------------------------------------
    def enter(self, arm: str, mode: Mode | None, num_verify_replicas: int | None) -> Refusal | None:
        adm = self.admissions.get(arm)
        if adm is None:
            return None
        if num_verify_replicas:
            adm.set_replicas(num_verify_replicas)
        self._note_limit(arm, adm)
        if adm.try_enter(mode):
            self._count(arm, "admit")
            self._note_shedding(arm, adm)
            return None
        is_full = adm.num_in_flight >= adm.hard_limit
        self._count(arm, "full" if is_full else "shed", adm.refusal_reason(mode))
        self._note_shedding(arm, adm)
        message = ("the server is at capacity; retry later" if is_full else
                   "the server cannot answer this request within its latency target now; retry later")
        return Refusal(429, message, "rate_limit_error", "overloaded",
                       {"Retry-After": str(adm.retry_after_s(mode))})

    # ---- published to the front door -------------------------------------------------------------
    def published_headers(self, mode: Mode | None) -> list[tuple[bytes, bytes]]:
        """What the front door refuses by: requests in flight this replica admits (all arms; past it the front
        door still lets a few a second through, which admission counts as demand for the autoscaler), and
        the predicted wait."""
        if not self.admissions:
            return []
        limit = sum(a.current_limit(mode) for a in self.admissions.values())
        return [(LIMIT_HEADER.encode(), str(limit).encode()),
                (RETRY_HEADER.encode(), str(self.retry_after_s(mode)).encode())]

    def retry_after_s(self, mode: Mode | None) -> int:
        return min((a.retry_after_s(mode) for a in self.admissions.values()), default=1)

    # ---- what the autoscaler reads ---------------------------------------------------------------
    def autoscaling_stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for arm, a in self.admissions.items():
            out[f"admission_pressure:{arm}"] = a.pressure()
            out[f"admission_limit:{arm}"] = float(a.sla_limit())
            out[f"admission_in_flight:{arm}"] = float(a.num_in_flight)
        return out

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _count(self, arm: str | None, decision: str, reason: str | None = None) -> None:
        m = self.metrics.get(arm or "") or next(iter(self.metrics.values()), None)
        if m is not None:
            m.inc("dspark_admission_decisions_total", decision=decision)
            if reason is not None:
                m.inc("dspark_admission_refused_total", reason=reason)

    def _note_limit(self, arm: str, adm: Admission) -> None:
        """Log a change of the arm's SLA limit (at most once a second) or of the verify replicas it counts
        (at once), with what bounds the limit and the predicted latency there."""
        if adm.sla is None:
            return
        limit, replicas, now = adm.sla_limit(), adm.num_verify_replicas, time.monotonic()
        before = self._logged.get(arm)
        if before is None:
            self._logged[arm] = (limit, replicas, now)
            return
        if (limit, replicas) == before[:2] or (replicas == before[1] and now - before[2] < LIMIT_LOG_INTERVAL_S):
            return
        self._logged[arm] = (limit, replicas, now)
        m = adm.model
        log.info("admission %s: limit %d -> %d, %d verify replica(s)%s, bound by %s; predicted TTFT %s s / TPOT "
                 "%s s at the limit, %s s / %s s one past it; TTFT bins %s", arm, before[0], limit, replicas,
                 f" (was {before[1]})" if replicas != before[1] else "", adm.limit_reason,
                 _fmt(m.predicted_ttft_s(limit)), _fmt(m.predicted_tpot_s(limit)),
                 _fmt(m.predicted_ttft_s(limit + 1)), _fmt(m.predicted_tpot_s(limit + 1)),
                 {k: round(v, 3) for k, v in sorted(m.ttft.means.items())})

    def _note_shedding(self, arm: str, adm: Admission) -> None:
        """Log the start and the end of shedding (not every refusal), with what decided it."""
        recent = [ok for t, ok in adm._arrivals if time.monotonic() - t < 2.0]
        is_shedding = bool(recent) and not all(recent)
        if is_shedding == self._is_shedding.get(arm, False):
            return
        self._is_shedding[arm] = is_shedding
        m = adm.model
        n = adm.num_in_flight
        if is_shedding:
            self._shed_since[arm] = time.monotonic()
            log.warning("admission %s: shedding: %d in flight, limit %d (static %d), %d verify replica(s), "
                        "bound by %s, predicted TTFT %s s / TPOT %s s at the limit, pressure %.2f", arm, n,
                        adm.sla_limit(), adm.hard_limit, adm.num_verify_replicas, adm.limit_reason,
                        _fmt(m.predicted_ttft_s(adm.sla_limit())), _fmt(m.predicted_tpot_s(adm.sla_limit())),
                        adm.pressure())
        else:
            since = self._shed_since.pop(arm, time.monotonic())
            log.warning("admission %s: stopped shedding after %.1f s: limit %d, %d verify replica(s)", arm,
                        time.monotonic() - since, adm.sla_limit(), adm.num_verify_replicas)

    def _gauges(self, arm: str, m: Metrics) -> None:
        a = self.admissions[arm]
        m.set("dspark_admission_limit", a.sla_limit())
        m.set("dspark_admission_replicas", a.num_verify_replicas)
        m.set("dspark_admission_pressure", a.pressure())


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f}"
