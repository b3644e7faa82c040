"""Distribution tests: speculative generation must produce exactly the target's sequences.

Toy world: the target's next-token distribution depends only on the absolute position m
(P_m = softmax(logits_m / T) with top-p), not on the tokens before it, so the target's law of
the first L tokens is the product P_0 x ... x P_{L-1}. Many independent "requests" generate
L tokens each through `verify`, all in one flattened batch per step, with a per-request
number of drafts that changes every step (0 included). The empirical joint of the L tokens
and each position's marginal are then compared with the target by chi-square tests.

False-failure odds: each test makes 1 + L = 4 checks at ALPHA = 1e-4, so a correct verifier
fails a given test with probability <= 4e-4 over the choice of seed. Seeds are fixed, so the
outcome is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dspark.spec.chi2 import ALPHA, chi_square_pvalue, counts_of
from dspark.spec.sampling import exponential_noise, logits_to_probs, sample_from_probs
from dspark.spec.verification import VerifyInput, VerifyOutput, verify

VOCAB_SIZE = 6
NUM_TOKENS = 3  # L: tokens generated per request and compared with the target
MAX_NUM_DRAFT = 3
NUM_REQUESTS = 12_000
NUM_POSITIONS = NUM_TOKENS + MAX_NUM_DRAFT + 1  # rows any step can touch

Verifier = Callable[[VerifyInput], VerifyOutput]


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Straightforward per-row temperature + top-p, independent of `logits_to_probs`."""
    rows = []
    for row in logits.double():
        probs = torch.softmax(row / temperature, dim=-1)
        order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += float(probs[i])
            if mass >= top_p:
                break
        filtered = torch.zeros_like(probs)
        filtered[kept] = probs[kept]
        rows.append(filtered / filtered.sum())
    return torch.stack(rows)


def generate(
    verifier: Verifier,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    *,
    is_point_mass: bool,
    temperature: float,
    top_p: float,
    seed: int,
) -> torch.Tensor:
    """(NUM_REQUESTS, NUM_TOKENS) tokens generated speculatively.

    target_logits, draft_probs: (NUM_POSITIONS, V), indexed by absolute position. Draft
    tokens are sampled from draft_probs; with ``is_point_mass`` the verifier is told the
    drafts are deterministic (draft_probs=None), which must stay lossless for any rule that
    picks draft tokens independently of the verifier's randomness.
    """
    torch.manual_seed(seed)  # the verifier draws from the global RNG (generators None)
    rng = torch.Generator().manual_seed(seed + 1)
    outputs: list[list[int]] = [[] for _ in range(NUM_REQUESTS)]
    while True:
        active = [r for r in range(NUM_REQUESTS) if len(outputs[r]) < NUM_TOKENS]
        if not active:
            break
        num_draft = torch.randint(0, MAX_NUM_DRAFT + 1, (len(active),), generator=rng).tolist()
        positions = [
            len(outputs[r]) + j for r, n in zip(active, num_draft, strict=True) for j in range(n + 1)
        ]
        rows = torch.tensor(positions)  # (T,)
        row_draft_probs = draft_probs[rows]  # (T, V)
        draft_tokens = torch.multinomial(row_draft_probs, 1, generator=rng).squeeze(1)  # (T,)
        inp = VerifyInput(
            target_logits=target_logits[rows],
            draft_tokens=draft_tokens,
            draft_probs=None if is_point_mass else row_draft_probs,
            num_draft=num_draft,
            temperature=[temperature] * len(active),
            top_p=[top_p] * len(active),
            generators=[None] * len(active),
        )
        out = verifier(inp)
        tokens = draft_tokens.tolist()
        offset = 0
        for r, n, n_acc, nxt in zip(active, num_draft, out.num_accepted, out.next_token, strict=True):
            assert 0 <= n_acc <= n
            outputs[r].extend(tokens[offset : offset + n_acc] + [nxt])
            offset += n + 1
    return torch.tensor([seq[:NUM_TOKENS] for seq in outputs])


def pvalues_against_target(sequences: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """Chi-square p-values of the joint of all L tokens and of each position's marginal."""
    joint_index = torch.zeros(sequences.shape[0], dtype=torch.long)
    joint_probs = torch.ones(1, dtype=torch.float64)
    for m in range(NUM_TOKENS):
        joint_index = joint_index * VOCAB_SIZE + sequences[:, m]
        joint_probs = torch.outer(joint_probs, target[m]).flatten()
    pvalues = {"joint": chi_square_pvalue(counts_of(joint_index, VOCAB_SIZE**NUM_TOKENS), joint_probs)}
    for m in range(NUM_TOKENS):
        pvalues[f"position {m}"] = chi_square_pvalue(counts_of(sequences[:, m], VOCAB_SIZE), target[m])
    return pvalues


def toy_world(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random target logits and draft distributions (NUM_POSITIONS, V) each."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(NUM_POSITIONS, VOCAB_SIZE, generator=gen)
    draft_probs = torch.softmax(1.5 * torch.randn(NUM_POSITIONS, VOCAB_SIZE, generator=gen), -1)
    return target_logits, draft_probs


CASES = {
    "sampled drafts": {"is_point_mass": False, "temperature": 1.0, "top_p": 1.0},
    "sampled drafts, T=0.7, top-p 0.8": {"is_point_mass": False, "temperature": 0.7, "top_p": 0.8},
    "point-mass drafts": {"is_point_mass": True, "temperature": 1.0, "top_p": 1.0},
    "point-mass drafts, T=1.3, top-p 0.9": {
        "is_point_mass": True,
        "temperature": 1.3,
        "top_p": 0.9,
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_generation_matches_target_distribution(case: str) -> None:
    """Joint and per-position laws match the target; odds of a false failure <= 4e-4."""
    params = CASES[case]
    target_logits, draft_probs = toy_world(seed=11)
    sequences = generate(verify, target_logits, draft_probs, seed=5, **params)
    target = reference_probs(target_logits, params["temperature"], params["top_p"])
    pvalues = pvalues_against_target(sequences, target)
    assert min(pvalues.values()) >= ALPHA, pvalues


def test_top_p_filtering_is_exercised_by_the_toy_world() -> None:
    """Guards the top-p cases above against silently testing nothing: some target mass is cut."""
    target_logits, _ = toy_world(seed=11)
    filtered = reference_probs(target_logits, 0.7, 0.8)
    assert bool((filtered[:NUM_TOKENS] == 0).any())
    torch.testing.assert_close(
        logits_to_probs(
            target_logits,
            torch.full((NUM_POSITIONS,), 0.7),
            torch.full((NUM_POSITIONS,), 0.8),
        ),
        filtered.float(),
    )


def _row_offsets(num_draft: list[int]) -> torch.Tensor:
    counts = torch.tensor(num_draft) + 1
    return counts.cumsum(0) - counts  # (R,) first row of each request


def _sample_target_rows(inp: VerifyInput, rows: torch.Tensor) -> list[int]:
    probs = logits_to_probs(inp.target_logits[rows], torch.tensor(inp.temperature), torch.tensor(inp.top_p))
    return sample_from_probs(probs, exponential_noise(probs.shape, None, "cpu")).tolist()


def accept_everything(inp: VerifyInput) -> VerifyOutput:
    """Biased on purpose: accepts every draft token, then samples the bonus from the target."""
    bonus_rows = _row_offsets(inp.num_draft) + torch.tensor(inp.num_draft)
    return VerifyOutput(num_accepted=list(inp.num_draft), next_token=_sample_target_rows(inp, bonus_rows))


def resample_without_residual(inp: VerifyInput) -> VerifyOutput:
    """Biased on purpose (a classic bug): after a rejection, samples from p instead of the
    residual norm(max(0, p - q))."""
    out = verify(inp)
    rows = _row_offsets(inp.num_draft) + torch.tensor(out.num_accepted)
    fresh = _sample_target_rows(inp, rows)
    next_token = [
        fresh_token if num_accepted < num_draft else token
        for fresh_token, token, num_accepted, num_draft in zip(
            fresh, out.next_token, out.num_accepted, inp.num_draft, strict=True
        )
    ]
    return VerifyOutput(num_accepted=out.num_accepted, next_token=next_token)


@pytest.mark.parametrize("biased_verifier", [accept_everything, resample_without_residual])
def test_distribution_test_detects_a_biased_verifier(biased_verifier: Verifier) -> None:
    """Negative control: the same harness and threshold must reject a wrong verifier."""
    target_logits, draft_probs = toy_world(seed=11)
    sequences = generate(
        biased_verifier,
        target_logits,
        draft_probs,
        is_point_mass=False,
        temperature=1.0,
        top_p=1.0,
        seed=5,
    )
    pvalues = pvalues_against_target(sequences, reference_probs(target_logits, 1.0, 1.0))
    assert min(pvalues.values()) < ALPHA, pvalues
