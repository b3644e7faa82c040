"""One request's timing: the ingress metrics, and its line in the request log for `dspark ab report`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dspark.cluster.ingress.latency_model import LatencyModel
from dspark.cluster.ingress.text_stream import TextStream
from dspark.metrics.series import Metrics
from dspark.verify_service.request import RequestOutput


@dataclass
class RequestRecord:
    """One request's timing: the ingress metrics, and its line in the request log for `dspark ab report`."""

    arm: str
    request_id: str
    start_wall_s: float
    start_s: float
    log_file: Any
    metrics: Metrics | None = None
    num_prompt_tokens: int = 0
    first_s: float = 0.0
    last_s: float = 0.0
    model: LatencyModel | None = None  # the arm's latency model: it measures tokens per running request
    charge: Callable[[int], None] | None = None  # the key's tokens quota, charged at the end
    num_outputs: int = 0

    def on_output(self, out: RequestOutput) -> None:
        """An output reached the client: one inter-token-latency observation (vLLM: one per delivery)."""
        now = time.perf_counter()
        if self.model is not None and self.num_outputs and out.new_token_ids:
            self.model.tokens(len(out.new_token_ids))
        self.num_outputs += 1
        if self.metrics is not None and self.last_s and out.new_token_ids:
            self.metrics.observe("vllm:inter_token_latency_seconds", now - self.last_s)
        if out.new_token_ids:
            self.last_s = now

    def write(self, stream: TextStream, is_error: bool, is_aborted: bool = False) -> None:
        """`is_aborted`: the client went away mid-request (vLLM's finish reason `abort`); the engine's
        generator has been closed, which frees its KV slot and draft context."""
        now = time.perf_counter()
        n = len(stream.token_ids)
        if self.charge is not None:
            self.charge(self.num_prompt_tokens + n)
        m = self.metrics
        if m is not None:
            if is_aborted:
                m.inc("vllm:generation_tokens_total", n)
                m.inc("vllm:request_success_total", finished_reason="abort")
            elif is_error:
                m.inc("dspark_request_errors_total", status="stream")
            else:
                m.observe("vllm:time_to_first_token_seconds", self.first_s - self.start_s)
                m.observe("vllm:e2e_request_latency_seconds", now - self.start_s)
                if n > 1:
                    m.observe("vllm:request_time_per_output_token_seconds", (now - self.first_s) / (n - 1))
                m.inc("vllm:prompt_tokens_total", self.num_prompt_tokens)
                m.inc("vllm:generation_tokens_total", n)
                m.inc("vllm:request_success_total", finished_reason=stream.finish_reason or "stop")
        if self.log_file is None:
            return
        self.log_file.write(json.dumps({
            "arm": self.arm, "request_id": self.request_id, "start_s": self.start_wall_s,
            "ttft_s": self.first_s - self.start_s, "e2e_s": now - self.start_s,
            "num_output_tokens": n, "num_steps": stream.num_steps,
            "num_verified": stream.num_verified, "num_accepted": stream.num_accepted, "is_error": is_error,
            "is_aborted": is_aborted}) + "\n")
