"""Every metric the cluster exports: name, kind, help, buckets, labels (one table, one place).

Metrics travel the Ray way: each process records them with `ray.util.metrics`; Ray's metrics agent on
each node exports them, so a multi-node cluster is scraped node by node like any Ray cluster (Ray writes
the Prometheus file-discovery list of its agents). Ray does not allow ':' in names and prefixes `ray_`,
so vLLM's `vllm:num_requests_running` leaves the agent as `ray_vllm_num_requests_running`; the ingress's
`GET /metrics` (see `metrics/export.py`) gathers every node's agent and gives the series back their vLLM
names, so vLLM dashboards and alerts work unchanged on it.

Labels: `model_name` (vLLM's), `arm` (A/B arm), `pool` (ingress | verify | draft | scheduler), `replica`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

LABELS = ("model_name", "arm", "pool", "replica")

# latency buckets (s): vLLM's ITL buckets start at 10 ms; a CPU speculative step can be shorter
_FAST_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
           0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
              45.0, 60.0, 120.0)
_MS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exported on /metrics (vLLM's where it has one)
    kind: str  # counter | gauge | histogram
    help: str
    extra_labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def ray_name(self) -> str:
        """What it is called inside Ray (no ':'), exported by the agents as `ray_<ray_name>`."""
        return self.name.replace(":", "_")


_SPECS = [
    # requests (ingress)
    MetricSpec("vllm:time_to_first_token_seconds", "histogram", "Time to first token.", buckets=_REQUEST_S),
    MetricSpec("vllm:inter_token_latency_seconds", "histogram",
               "Time between two consecutive outputs of a request (one per delivery, as vLLM).", buckets=_FAST_S),
    MetricSpec("vllm:request_time_per_output_token_seconds", "histogram",
               "Per request: (e2e - TTFT) / (output tokens - 1).", buckets=_FAST_S),
    MetricSpec("vllm:e2e_request_latency_seconds", "histogram", "End-to-end request latency.", buckets=_REQUEST_S),
    MetricSpec("vllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests."),
    MetricSpec("vllm:generation_tokens_total", "counter", "Generated tokens of finished requests."),
    MetricSpec("vllm:request_success_total", "counter", "Finished requests, by finish reason.",
               ("finished_reason",)),
    MetricSpec("dspark_request_errors_total", "counter", "Requests answered with an error, by HTTP status.",
               ("status",)),
    MetricSpec("dspark_admission_decisions_total", "counter", "Admission decisions at the ingress: admit, shed "
               "(over the SLA's predicted latency), full (the static bound), quota (a key over its quota).",
               ("decision",)),
    MetricSpec("dspark_admission_refused_total", "counter", "Requests admission refused, by reason: ttft / tpot "
               "(one more request's predicted latency over the SLA), unmeasured (before any measurement: one batch "
               "per verify replica), full (the static bound), quota (a key over its quota).", ("reason",)),
    MetricSpec("dspark_admission_limit", "gauge", "Requests in flight the arm admits within the SLA (ingress)."),
    MetricSpec("dspark_admission_replicas", "gauge", "Verify replicas the arm's admission counts (its limit grows "
               "with them)."),
    MetricSpec("dspark_admission_pressure", "gauge", "Demand over what the arm's replicas serve within the SLA "
               "(over 1: shedding, the autoscaler adds replicas)."),
    # engine (verify replicas, or the inline replica)
    MetricSpec("vllm:num_requests_running", "gauge", "Requests in the step loop."),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Requests queued for a KV slot."),
    MetricSpec("vllm:spec_decode_num_drafts_total", "counter", "Request-rounds that verified draft tokens."),
    MetricSpec("vllm:spec_decode_num_draft_tokens_total", "counter",
               "Draft tokens the target verified (the scheduled prefix, not all drafted)."),
    MetricSpec("vllm:spec_decode_num_accepted_tokens_total", "counter", "Verified draft tokens accepted."),
    MetricSpec("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
               "Accepted draft tokens by position in the block (0-based, as vLLM).", ("position",)),
    MetricSpec("dspark_draft_source_proposals_total", "counter",
               "Drafts proposed, by source (suffix/hybrid drafters: request, corpus, dspark), chosen or not.",
               ("source",)),
    MetricSpec("dspark_draft_source_chosen_total", "counter", "Drafts chosen for verification, by source.",
               ("source",)),
    MetricSpec("dspark_draft_source_verified_tokens_total", "counter", "Draft tokens verified, by source.",
               ("source",)),
    MetricSpec("dspark_draft_source_accepted_tokens_total", "counter", "Draft tokens accepted, by source.",
               ("source",)),
    MetricSpec("dspark_draft_source_accepted_per_pos_total", "counter",
               "Accepted draft tokens by source and position (0-based).", ("source", "position")),
    # half-integer bounds: an integer l falls in (l - 0.5, l + 0.5], whose midpoint is l, so the sum Ray
    # rebuilds from bucket midpoints (it does not keep the exact sum) is exact
    MetricSpec("dspark_verification_length", "histogram",
               "Draft tokens verified per request-round that verified any (l > 0).",
               buckets=tuple(b + 0.5 for b in range(0, 17))),
    MetricSpec("dspark_step_tokens", "histogram", "Tokens through the target per step (B).",
               buckets=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)),
    MetricSpec("dspark_step_seconds", "histogram", "Verify (target forward) time per step.", buckets=_FAST_S),
    MetricSpec("dspark_capacity_k", "gauge", "Verification capacity K set for this verify replica."),
    MetricSpec("dspark_predicted_survival_total", "counter",
               "Sum of predicted prefix survival a_k at verified positions (live calibration), by position.",
               ("position",)),
    MetricSpec("dspark_observed_survival_total", "counter",
               "Verified positions whose prefix survived, by position.", ("position",)),
    MetricSpec("dspark_verified_positions_total", "counter", "Verified positions carrying a prediction.",
               ("position",)),
    MetricSpec("dspark_draft_gate_open", "gauge", "1 while the draft gate lets this replica draft, else 0."),
    MetricSpec("dspark_transport_seconds", "histogram", "Verify<->draft round-trip transfer time per round.",
               buckets=_MS_S),
    MetricSpec("dspark_draft_wait_seconds", "histogram", "Time the verify side waited for a draft per round.",
               buckets=_MS_S),
    # draft replicas
    MetricSpec("dspark_draft_busy_seconds_total", "counter", "Time spent drafting (rate = utilisation)."),
    MetricSpec("dspark_draft_contexts", "gauge", "Requests with a draft-side context."),
    # scheduler and pools
    MetricSpec("dspark_scheduler_decision_seconds", "histogram", "SchedulerActor time per decision.",
               ("decision",), buckets=_MS_S),
    MetricSpec("dspark_pool_replicas", "gauge", "Replicas in a pool (as the ingress sees them)."),
    MetricSpec("dspark_autoscale_decisions_total", "counter", "Autoscaling decisions per pool: up, down, hold.",
               ("direction", "target_pool")),
    MetricSpec("dspark_autoscale_target_replicas", "gauge", "The autoscaler's target replicas per pool.",
               ("target_pool",)),
]
SPECS = {s.name: s for s in _SPECS}


class Metrics:
    """This process's handles to the metrics, bound to its labels. A no-op outside a Ray worker (plain
    engines in tests and benchmarks), so the same code runs everywhere."""

    def __init__(self, model_name: str, arm: str, pool: str, replica: str) -> None:
        self.labels = {"model_name": model_name, "arm": arm, "pool": pool, "replica": replica}
        self._handles: dict[str, Any] = {}
        self.is_enabled = _in_ray_worker()

    def _get(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            from ray.util import metrics as rm

            spec = SPECS[name]
            keys = LABELS + spec.extra_labels
            if spec.kind == "counter":
                handle = rm.Counter(spec.ray_name, spec.help, tag_keys=keys)
            elif spec.kind == "gauge":
                handle = rm.Gauge(spec.ray_name, spec.help, tag_keys=keys)
            else:
                handle = rm.Histogram(spec.ray_name, spec.help, boundaries=list(spec.buckets), tag_keys=keys)
            self._handles[name] = handle
        return handle

    def _tags(self, extra: dict[str, str] | None) -> dict[str, str]:
        return {**self.labels, **extra} if extra else self.labels

    def inc(self, name: str, value: float = 1.0, **extra: str) -> None:
        if self.is_enabled and value > 0:
            self._get(name).inc(value, tags=self._tags(extra))

    def set(self, name: str, value: float, **extra: str) -> None:
        if self.is_enabled:
            self._get(name).set(value, tags=self._tags(extra))

    def observe(self, name: str, value: float, **extra: str) -> None:
        if self.is_enabled:
            self._get(name).observe(value, tags=self._tags(extra))

    def refresh_every(self, set_gauges: Callable[[], None], interval_s: float = 5.0) -> None:
        """Call `set_gauges` now and every `interval_s` on a daemon thread: Ray's agent drops a gauge that
        was not set for a while (~20 s), so a gauge of an idle process must be set again."""
        if not self.is_enabled:
            return

        def loop() -> None:
            while True:
                try:
                    set_gauges()
                except Exception:  # noqa: BLE001 - a metric must never take a process down
                    log.exception("gauge refresh failed")
                time.sleep(interval_s)

        threading.Thread(target=loop, name="dspark-gauges", daemon=True).start()


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except Exception:  # noqa: BLE001 - metrics must never break serving
        return False
