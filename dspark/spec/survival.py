"""Prefix survival probabilities a_{r,j}: the chance that draft token j of request r and every
token before it are accepted. Schedulers rank draft tokens by these numbers."""

from __future__ import annotations

import itertools
import operator

import torch


def prefix_survival(confidences: torch.Tensor, num_draft: torch.Tensor | None = None) -> torch.Tensor:
    """Cumulative products of per-position confidences: a_{r,j} = prod_{i<=j} c_{r,i}.

    Args:
        confidences: (R, gamma) conditional acceptance estimates c_{r,i} in [0, 1].
        num_draft: optional (R,) number of real draft tokens per request; positions
            j >= num_draft[r] (0-based) get survival 0 so no scheduler selects them.

    Returns:
        (R, gamma) survival, same dtype as ``confidences``.
    """
    survival = torch.cumprod(confidences, dim=-1)  # (R, gamma)
    if num_draft is None:
        return survival
    positions = torch.arange(confidences.shape[-1], device=confidences.device)  # (gamma,)
    is_real = positions.unsqueeze(0) < num_draft.to(confidences.device).unsqueeze(-1)
    return torch.where(is_real, survival, torch.zeros_like(survival))


def prefix_survival_rows(confidences: list[list[float]]) -> list[list[float]]:
    """`prefix_survival` of one step's ragged rows as Python floats: each row's running products. A step schedules
    a few rows of at most γ numbers each; building the padded tensor for them cost more than the products
    (~0.2 ms a step at batch 8, more than the scheduler's own work)."""
    return [list(itertools.accumulate(row, operator.mul)) for row in confidences]


class AcceptanceTracker:
    """Running per-position conditional acceptance rates, for drafters without confidences.

    Position j's estimate is P(draft j accepted | drafts 0..j-1 accepted), an exponentially
    decayed success ratio seeded with a pseudo-observation at ``prior``. Survival for a
    request is the running product of these rates.

    Lossless use: the estimates depend only on outcomes of PAST verification steps, never on
    the draft tokens of the current step, so a scheduler fed these survivals cannot let a
    drafted token influence whether that same token is verified (the failure mode of
    Appendix A of the DSpark paper). Keep it that way: call `update` after verification,
    `survival` before it.
    """

    _PRIOR_WEIGHT = 1.0  # pseudo-trials behind the prior

    def __init__(self, max_num_positions: int, prior: float = 0.7, decay: float = 0.98,
                 idle_decay: float = 0.98) -> None:
        """`idle_decay`: each step without a trial at a position moves its evidence that much back toward the
        prior's single pseudo-trial. Without it, one rejected round can push an estimate low enough that the
        scheduler never verifies that position again, and the estimate, with no new trials, never recovers:
        the drafter would be written off for good on one bad round. With it, such a position is tried again
        after some tens of steps (a drafter that keeps failing is probed about once per 50-200 steps)."""
        if max_num_positions < 1:
            raise ValueError(f"max_num_positions must be >= 1, got {max_num_positions}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0.0 < idle_decay <= 1.0:
            raise ValueError(f"idle_decay must be in (0, 1], got {idle_decay}")
        self.idle_decay = idle_decay
        self.max_num_positions = max_num_positions
        self.prior = prior
        self.decay = decay
        self._num_trials = [self._PRIOR_WEIGHT] * max_num_positions
        self._num_successes = [prior * self._PRIOR_WEIGHT] * max_num_positions

    def update(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """Record one verification step.

        Position j of request r is a trial iff j < num_draft[r] and j <= num_accepted[r]
        (it was verified and everything before it was accepted); a success iff
        j < num_accepted[r]. Positions beyond ``max_num_positions`` are not tracked. Only
        positions with at least one trial this step decay, so estimates for rarely drafted
        positions do not fade into noise; a position without a trial relaxes toward the prior instead
        (`idle_decay`), which only depends on past steps too.
        """
        if len(num_draft) != len(num_accepted):
            raise ValueError(f"len(num_draft)={len(num_draft)} != len(num_accepted)={len(num_accepted)}")
        step_trials = [0] * self.max_num_positions
        step_successes = [0] * self.max_num_positions
        for drafted, accepted in zip(num_draft, num_accepted, strict=True):
            if not 0 <= accepted <= drafted:
                raise ValueError(f"need 0 <= num_accepted <= num_draft, got {accepted}, {drafted}")
            for j in range(min(drafted, accepted + 1, self.max_num_positions)):
                step_trials[j] += 1
                step_successes[j] += int(j < accepted)
        for j in range(self.max_num_positions):
            if step_trials[j] == 0:
                w = self._PRIOR_WEIGHT
                self._num_trials[j] = w + self.idle_decay * (self._num_trials[j] - w)
                self._num_successes[j] = self.prior * w + self.idle_decay * (self._num_successes[j] - self.prior * w)
                continue
            self._num_trials[j] = self.decay * self._num_trials[j] + step_trials[j]
            self._num_successes[j] = self.decay * self._num_successes[j] + step_successes[j]

    def conditional(self) -> list[float]:
        """Per-position conditional acceptance estimates, length ``max_num_positions``."""
        return [min(1.0, max(0.0, s / t)) for s, t in zip(self._num_successes, self._num_trials, strict=True)]

    def survival(self, num_proposed: list[int]) -> list[list[float]]:
        """Per request, the cumulative products of `conditional` for its ``num_proposed[r]``
        positions. Positions beyond ``max_num_positions`` reuse the last position's rate."""
        conditional = self.conditional()
        max_len = max(num_proposed, default=0)
        cumulative: list[float] = []
        running = 1.0
        for j in range(max_len):
            running *= conditional[min(j, self.max_num_positions - 1)]
            cumulative.append(running)
        return [cumulative[:n] for n in num_proposed]
