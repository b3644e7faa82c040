"""Appendix A of the DSpark paper as a test: a scheduler that peeks at a drafted token's
continuation confidence before deciding whether to verify it biases the output.

World: one request, gamma = 2, SPS {1: 1.0, 2: 0.5, 3: 0.45}, vocabulary {A, B},
target p_t = (0.7, 0.3), draft p_d = (0.5, 0.5). Confidence c1 = 0.8 before any token;
c2 = 0.9 if x1 = A else 0.0 (a Markov confidence head). Each trial drafts x1, x2 ~ p_d,
schedules from the realised survival, verifies, and records the first emitted token.

False-failure odds: each lossless scheduler's check fails a correct implementation with
probability ALPHA = 1e-4 over the seed; the bias check on GlobalSearch has a deterministic
verdict at this seed (the shift 0.7 -> 0.85 sits hundreds of standard errors away).
"""

from __future__ import annotations

import pytest
import torch

from dspark.spec.chi2 import counts_of, matches
from dspark.spec.schedulers import (
    AsyncCapacity,
    GlobalSearch,
    GreedyEarlyStop,
    Scheduler,
)
from dspark.spec.sps import SPSTable
from dspark.spec.verification import VerifyInput, verify

A, B = 0, 1
TARGET = torch.tensor([0.7, 0.3])
DRAFT = torch.tensor([0.5, 0.5])
BIASED = torch.tensor([0.85, 0.15])  # the paper's closed form for GlobalSearch
NUM_TRIALS = 20_000
SPS = SPSTable.from_sps({1: 1.0, 2: 0.5, 3: 0.45})


def survival_after(x1: int) -> list[float]:
    c1 = 0.8
    c2 = 0.9 if x1 == A else 0.0
    return [c1, c1 * c2]


def first_tokens(scheduler: Scheduler, seed: int) -> tuple[torch.Tensor, list[int]]:
    """(NUM_TRIALS,) first emitted tokens and the scheduled lengths, one trial per request."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(DRAFT, 2 * NUM_TRIALS, replacement=True, generator=gen)
    drafts = drafts.view(NUM_TRIALS, 2).tolist()
    # Each trial is one scheduling step of a one-request batch.
    lengths = [scheduler.schedule([survival_after(x1)], SPS)[0] for x1, _ in drafts]

    draft_rows: list[int] = []
    for (x1, x2), length in zip(drafts, lengths, strict=True):
        draft_rows.extend([x1, x2][:length] + [A])  # the bonus row's value is ignored
    num_rows = len(draft_rows)
    torch.manual_seed(seed + 1)
    out = verify(
        VerifyInput(
            target_logits=TARGET.log().expand(num_rows, 2),
            draft_tokens=torch.tensor(draft_rows),
            draft_probs=DRAFT.expand(num_rows, 2),
            num_draft=lengths,
            temperature=[1.0] * NUM_TRIALS,
            top_p=[1.0] * NUM_TRIALS,
            generators=[None] * NUM_TRIALS,
        )
    )
    first = [
        x1 if num_accepted >= 1 else nxt
        for (x1, _), num_accepted, nxt in zip(drafts, out.num_accepted, out.next_token, strict=True)
    ]
    return torch.tensor(first), lengths


def test_paper_lengths_greedy_stops_before_any_draft() -> None:
    greedy = GreedyEarlyStop()
    assert greedy.schedule([survival_after(A)], SPS) == [0]
    assert greedy.schedule([survival_after(B)], SPS) == [0]


def test_paper_lengths_global_search_peeks_at_the_drafted_token() -> None:
    search = GlobalSearch()
    assert search.schedule([survival_after(A)], SPS) == [2]  # Theta_2 = 1.134 > 1.0
    assert search.schedule([survival_after(B)], SPS) == [0]  # Theta_2 = 0.81 < 1.0


@pytest.mark.parametrize(
    "scheduler", [GreedyEarlyStop(), AsyncCapacity(delay_steps=2)], ids=["greedy", "async"]
)
def test_lossless_schedulers_reproduce_the_target(scheduler: Scheduler) -> None:
    tokens, lengths = first_tokens(scheduler, seed=0)
    assert matches(counts_of(tokens, 2), TARGET)
    if isinstance(scheduler, AsyncCapacity):
        # Its capacity comes from the table two steps back, so drafts do get verified here.
        assert sum(lengths) > 0


def test_global_search_is_detected_as_biased_by_the_same_check() -> None:
    tokens, _ = first_tokens(GlobalSearch(), seed=0)
    counts = counts_of(tokens, 2)
    assert not matches(counts, TARGET)
    assert matches(counts, BIASED)  # and it lands where Appendix A predicts
