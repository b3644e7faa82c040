"""Per-request verification lengths l_r from prefix survival a_{r,j} and the SPS curve.

Every scheduler maximises (or approximates) the expected token throughput
Theta = tau * SPS(B), with B = sum_r (1 + l_r) tokens per step and
tau = sum_r (1 + sum_{j<=l_r} a_{r,j}) expected emitted tokens.

Losslessness rule: whether draft token j of request r is verified must not depend on that
token's own value. Survival a_{r,j+1} may depend on x_{r,j} (a Markov confidence head), so a
scheduler may only look at a_{r,j+1} after committing to verify x_{r,j}. Algorithm 1's early
stop, a fixed k, a threshold on a prefix, and a capacity taken from an old table all respect
this; `GlobalSearch` does not (DSpark paper, Appendix A).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from dspark.spec.sps import SPSTable

# (survival, position j (1-based), request r): sorting this key ascending orders candidates
# by survival descending, ties broken by smaller j, then smaller r. Because survival is
# non-increasing in j, any prefix of this order is prefix-closed within every request.
_Candidate = tuple[float, int, int]


class Scheduler(Protocol):
    """Chooses l_r in [0, len(survival[r])] for every request of one step."""

    name: str

    def schedule(self, survival: list[list[float]], sps: SPSTable) -> list[int]:
        """``survival[r]`` = [a_{r,1}, ..., a_{r,k_r}], non-increasing; k_r = tokens drafted."""
        ...


class FixedK:
    """Verify min(k, k_r) tokens of every request, regardless of survival."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def schedule(self, survival: list[list[float]], sps: SPSTable) -> list[int]:
        """See `Scheduler.schedule`."""
        return [min(self.k, len(row)) for row in survival]


class Threshold:
    """Verify the longest prefix whose survival stays >= ``threshold`` (load-unaware)."""

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def schedule(self, survival: list[list[float]], sps: SPSTable) -> list[int]:
        """See `Scheduler.schedule`."""
        lengths = []
        for row in survival:
            length = 0
            while length < len(row) and row[length] >= self.threshold:
                length += 1
            lengths.append(length)
        return lengths


class GreedyEarlyStop:
    """Algorithm 1 of the DSpark paper: greedy admission by survival, stop at the first drop.

    Candidates (r, j) with a_{r,j} > 0 are admitted in descending survival; the scheduler
    stops at the first candidate that does not strictly raise Theta. Lossless: the decision
    to stop before (r, j) is taken from candidates ranked above it, which never include
    survivals that depend on x_{r,j} itself.
    """

    name = "greedy"

    def schedule(self, survival: list[list[float]], sps: SPSTable) -> list[int]:
        """See `Scheduler.schedule`."""
        num_requests = len(survival)
        lengths = [0] * num_requests
        if num_requests == 0:
            return lengths
        num_tokens = num_requests
        expected_accepts = float(num_requests)
        best_theta = expected_accepts * sps.sps(num_tokens)
        for a, j, r in _sorted_candidates(survival):
            num_tokens += 1
            expected_accepts += a
            theta = expected_accepts * sps.sps(num_tokens)
            if theta <= best_theta:
                break
            best_theta = theta
            lengths[r] = j
        return lengths


class AsyncCapacity:
    """The asynchronous production scheduler of DSpark §5.2.

    The capacity K (draft tokens verified this step) is the global argmax of Theta along the
    full greedy admission path (no early stop, so jagged SPS curves cannot trap it) of the
    survival table seen ``delay_steps`` steps earlier. This step's candidates are then taken
    top-K by their CURRENT survival, with the same tie-breaking as Algorithm 1, which keeps
    every selection prefix-closed. Lossless: K depends only on past tables, and the top-K
    rank of (r, j) is decided by candidates ranked above it, like Algorithm 1.

    Until ``delay_steps`` tables have been seen, K is ``fallback_capacity`` when given, else
    the step falls back to `GreedyEarlyStop` on the current table. Each table's capacity is
    recorded after scheduling; old tables may hold a different number of requests, which is
    fine since K is a token count.
    """

    name = "async"

    def __init__(self, delay_steps: int = 2, fallback_capacity: int | None = None) -> None:
        if delay_steps < 1:
            raise ValueError(
                f"delay_steps must be >= 1 (0 would be GlobalSearch, not lossless), got {delay_steps}"
            )
        if fallback_capacity is not None and fallback_capacity < 0:
            raise ValueError(f"fallback_capacity must be >= 0, got {fallback_capacity}")
        self.delay_steps = delay_steps
        self.fallback_capacity = fallback_capacity
        self._capacity_history: deque[int] = deque(maxlen=delay_steps)

    def schedule(self, survival: list[list[float]], sps: SPSTable) -> list[int]:
        """See `Scheduler.schedule`; also records this table's capacity for later steps.

        A table with nothing drafted (a step the draft gate skipped) schedules nothing and is not
        recorded: its capacity 0 says nothing about what a drafted step can verify, and recording it
        would make the draft gate's next probe verify nothing, lose, and keep the gate shut.
        """
        if not any(survival):
            return [0] * len(survival)
        if len(self._capacity_history) == self.delay_steps:
            lengths = top_k_lengths(survival, self._capacity_history[0])
        elif self.fallback_capacity is not None:
            lengths = top_k_lengths(survival, self.fallback_capacity)
        else:
            lengths = GreedyEarlyStop().schedule(survival, sps)
        self._capacity_history.append(global_capacity(survival, sps))
        return lengths

    def reset(self) -> None:
        """Forget the history (e.g. when the batch is rebuilt from scratch)."""
        self._capacity_history.clear()


class GlobalSearch:
    """NOT LOSSLESS -- DO NOT SERVE WITH THIS. Exists only so tests can demonstrate the bias.

    Retrospective global argmax of Theta over the CURRENT table without early stop. When
    a_{r,j+1} depends on the drafted x_{r,j}, whether x_{r,j} is verified then depends on
    x_{r,j} itself, which skews the output distribution (DSpark paper, Appendix A: target
    (0.7, 0.3) comes out as (0.85, 0.15)). `AsyncCapacity` applies the same search to a table
    from earlier steps, which is what makes it safe.
    """

    name = "global_search"

    def schedule(self, survival: list[list[float]], sps: SPSTable) -> list[int]:
        """See `Scheduler.schedule` -- and the class docstring: this one is biased."""
        return top_k_lengths(survival, global_capacity(survival, sps))


def global_capacity(survival: list[list[float]], sps: SPSTable) -> int:
    """Number of draft tokens K at the argmax of Theta along the full admission path.

    Ties keep the smaller K. An empty batch has capacity 0.
    """
    num_requests = len(survival)
    if num_requests == 0:
        return 0
    expected_accepts = float(num_requests)
    best_theta = expected_accepts * sps.sps(num_requests)
    best_capacity = 0
    for num_admitted, (a, _, _) in enumerate(_sorted_candidates(survival), start=1):
        expected_accepts += a
        theta = expected_accepts * sps.sps(num_requests + num_admitted)
        if theta > best_theta:
            best_theta = theta
            best_capacity = num_admitted
    return best_capacity


def top_k_lengths(survival: list[list[float]], capacity: int) -> list[int]:
    """Lengths that verify the ``capacity`` best candidates (r, j) with a_{r,j} > 0."""
    lengths = [0] * len(survival)
    for _, j, r in _sorted_candidates(survival)[:capacity]:
        lengths[r] = j
    return lengths


def _sorted_candidates(survival: list[list[float]]) -> list[_Candidate]:
    """Candidates (a, j, r) with a > 0, best first.

    Survival is made non-increasing along each row (running minimum) so that a caller's
    rounding noise cannot break prefix-closure of the ranking.
    """
    candidates: list[_Candidate] = []
    for r, row in enumerate(survival):
        running_min = float("inf")
        for j, a in enumerate(row, start=1):
            running_min = min(running_min, a)
            if not running_min > 0:
                break
            candidates.append((running_min, j, r))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    return candidates


SCHEDULER_NAMES: tuple[str, ...] = ("fixed", "threshold", "greedy", "async")

_FACTORIES: dict[str, Callable[..., Scheduler]] = {
    "fixed": lambda k=7: FixedK(k),
    "threshold": lambda threshold=0.3: Threshold(threshold),
    "greedy": GreedyEarlyStop,
    "async": AsyncCapacity,
    "global_search": GlobalSearch,
}


def make_scheduler(name: str, **kwargs: Any) -> Scheduler:
    """Build a scheduler by name: "fixed" (k=7), "threshold" (threshold=0.3), "greedy",
    "async" (delay_steps=2, fallback_capacity=None), or the biased "global_search".

    Raises ValueError for an unknown name or options the scheduler does not take.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown scheduler {name!r}; valid names: {', '.join(_FACTORIES)}")
    try:
        return factory(**kwargs)
    except TypeError as err:  # unexpected keyword arguments
        raise ValueError(f"bad options {sorted(kwargs)} for scheduler {name!r}: {err}") from err
