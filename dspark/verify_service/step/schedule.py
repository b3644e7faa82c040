"""Schedule: how many of its drafted tokens each request verifies (ℓ_r), from survival estimates and the SPS
table. Lossless: the caps depend on request state and confidences only, never on the draft tokens."""

from __future__ import annotations

from dspark.models.drafters.base import DraftOutput
from dspark.spec.schedulers import Scheduler
from dspark.spec.sps import SPSTable
from dspark.spec.survival import AcceptanceTracker, prefix_survival_rows
from dspark.verify_service.request import Request


def schedule(active: list[Request], draft: DraftOutput, scheduler: Scheduler, tracker: AcceptanceTracker,
             sps: SPSTable | None) -> list[int]:
    """ℓ_r per request: the drafter's confidences (prefix survival) where it gives them, else the survival
    measured on recent rounds."""
    proposed = [len(t) for t in draft.tokens]
    if draft.confidences is not None:  # one per drafted token; a drafted token without one: survival 0
        survival = prefix_survival_rows([c[:k] + [0.0] * (k - len(c)) for c, k in zip(draft.confidences, proposed)])
    else:
        survival = tracker.survival(proposed)
    lengths = scheduler.schedule(survival, sps)  # type: ignore[arg-type]
    # never verify past max_tokens: caps depend on request state only, not on draft tokens
    return [max(0, min(n, r.num_remaining - 1)) for n, r in zip(lengths, active)]
