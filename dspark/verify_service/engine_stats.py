"""What an engine reports of its recent steps: a step timeline, the draft gate's view, the verify cost per band.

Shared by the verify worker (decoupled pools, `/v1/dspark/stats` through the pool engine) and the in-process
engine of an inline deployment (`AsyncEngine.stats`), so that both arms of a benchmark read alike.
"""

from __future__ import annotations

from typing import Any

from dspark.verify_service.engine import Engine

NUM_TIMELINE_STEPS = 512


def engine_stats(eng: Engine, num_steps: int = NUM_TIMELINE_STEPS) -> dict[str, Any]:
    """The last `num_steps` steps' timeline (start/end, requests, tokens, draft wait, verify time, tokens
    verified), the step counters, the draft gate's counts and per-batch-size state, and the measured cost
    of one more verified token."""
    steps = list(eng.stats)[-num_steps:]
    timeline = [{"micro_batch": s.micro_batch, "start_s": s.start_s, "end_s": s.end_s,
                 "num_requests": s.num_requests, "num_tokens": s.num_tokens, "draft_wait_ms": s.draft_ms,
                 "verify_ms": s.verify_ms, "num_verified": sum(s.lengths)} for s in steps]
    out: dict[str, Any] = {"num_steps": eng.num_steps, "num_running": len(eng.running),
                           "num_waiting": len(eng.waiting), "timeline": timeline}
    if eng.gate is not None:
        out["draft_gate"] = {"num_drafted": eng.gate.num_drafted, "num_skipped": eng.gate.num_skipped,
                             "gain_by_batch_size": eng.gate.gains(), "overhead_ms": eng.gate.overhead_ms,
                             "by_batch_size": eng.gate.summary()}
    if eng.token_cost is not None and eng.sps is not None:  # what one more verified token costs, per band
        out["token_cost"] = eng.token_cost.summary(eng.sps)
    if steps:
        out["verify_ms_mean"] = sum(s.verify_ms for s in steps) / len(steps)
    return out
