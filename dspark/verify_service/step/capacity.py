"""The verify worker's scheduler inside a cluster: K from the central scheduler, top-K chosen locally.

The central `SchedulerActor` sets the capacity K from a survival table at least one step old (§5.2,
asynchronous); each step the worker verifies its top-K candidates by CURRENT survival (prefix-closed,
lossless, like `AsyncCapacity`). The table reported is the last one that held drafts: while the draft
gate skips drafting, K stays based on what drafts last achieved, so the gate's next probe is verified
rather than cut to K = 0 by an empty table. While no K has arrived, or the last one is older than
`max_age_steps` (scheduler unreachable or restarting), the step falls back to local Algorithm 1.
"""

from __future__ import annotations

from dspark.spec.schedulers import GreedyEarlyStop, top_k_lengths
from dspark.spec.sps import SPSTable


class CentralCapacity:
    name = "central"

    def __init__(self, max_age_steps: int = 16) -> None:
        self.max_age_steps = max_age_steps
        self.capacity: int | None = None
        self.age_steps = 0
        self.fallback = GreedyEarlyStop()
        self.last_survival: list[list[float]] = []
        self.num_central_steps = 0
        self.num_fallback_steps = 0

    def set_capacity(self, capacity: int) -> None:
        self.capacity, self.age_steps = max(0, int(capacity)), 0

    def reset(self) -> None:
        """Forget K and the survival table: they describe a drafter this worker no longer has (it re-paired).
        Local Algorithm 1 until the scheduler answers a report made with the new one."""
        self.capacity, self.age_steps, self.last_survival = None, 0, []

    @property
    def is_fresh(self) -> bool:
        return self.capacity is not None and self.age_steps <= self.max_age_steps

    def schedule(self, survival: list[list[float]], sps: SPSTable) -> list[int]:
        self.age_steps += 1
        if any(survival):  # a step without drafts (draft gate closed) says nothing about survival: keep the last
            self.last_survival = [list(row) for row in survival]
        if not self.is_fresh:
            self.num_fallback_steps += 1
            return self.fallback.schedule(survival, sps)
        self.num_central_steps += 1
        return top_k_lengths(survival, self.capacity)  # type: ignore[arg-type]
