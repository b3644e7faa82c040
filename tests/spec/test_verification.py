"""Semantics of `verify` on hand-built and random batches (distributions: test_lossless.py)."""

from __future__ import annotations

import pytest
import torch

from dspark.spec.sampling import logits_to_probs
from dspark.spec.verification import VerifyInput, VerifyOutput, verify, verify_greedy

VOCAB_SIZE = 5


def _one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) logits whose argmax is the given token, with non-trivial runners-up."""
    logits = torch.linspace(0.0, 1.0, VOCAB_SIZE).repeat(len(tokens), 1)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def _greedy_input(target: list[int], drafts: list[int], num_draft: list[int]) -> VerifyInput:
    num_requests = len(num_draft)
    return VerifyInput(
        target_logits=_one_hot_logits(target),
        draft_tokens=torch.tensor(drafts),
        draft_probs=None,
        num_draft=num_draft,
        temperature=[0.0] * num_requests,
        top_p=[1.0] * num_requests,
        generators=[None] * num_requests,
    )


def _with_sampled_request(inp: VerifyInput) -> VerifyInput:
    """The same batch plus one sampled request at the end, which forces the general path."""
    extra_logits = torch.zeros(3, inp.target_logits.shape[1])
    draft_probs = None
    if inp.draft_probs is not None:
        draft_probs = torch.cat([inp.draft_probs, torch.full_like(extra_logits, 1 / VOCAB_SIZE)])
    return VerifyInput(
        target_logits=torch.cat([inp.target_logits, extra_logits]),
        draft_tokens=torch.cat([inp.draft_tokens, torch.tensor([1, 2, 0])]),
        draft_probs=draft_probs,
        num_draft=[*inp.num_draft, 2],
        temperature=[*inp.temperature, 1.0],
        top_p=[*inp.top_p, 1.0],
        generators=[*inp.generators, torch.Generator().manual_seed(0)],
    )


def _both_paths(inp: VerifyInput) -> list[VerifyOutput]:
    general = verify(_with_sampled_request(inp))
    num_requests = len(inp.num_draft)
    general = VerifyOutput(general.num_accepted[:num_requests], general.next_token[:num_requests])
    return [verify(inp), general]


def test_greedy_accepts_all_matching_drafts_and_emits_the_bonus_argmax() -> None:
    inp = _greedy_input(target=[3, 1, 4, 2], drafts=[3, 1, 4, 0], num_draft=[3])
    for out in _both_paths(inp):
        assert out == VerifyOutput(num_accepted=[3], next_token=[2])


def test_greedy_stops_at_the_first_mismatch_and_emits_that_rows_argmax() -> None:
    inp = _greedy_input(target=[3, 1, 4, 2], drafts=[3, 0, 4, 0], num_draft=[3])
    for out in _both_paths(inp):
        assert out == VerifyOutput(num_accepted=[1], next_token=[1])


def test_greedy_with_no_drafts_emits_the_argmax() -> None:
    inp = _greedy_input(target=[4], drafts=[0], num_draft=[0])
    for out in _both_paths(inp):
        assert out == VerifyOutput(num_accepted=[0], next_token=[4])


def test_requests_of_different_lengths_share_one_flattened_batch() -> None:
    # r0: 2 drafts, first wrong; r1: 0 drafts; r2: 3 drafts, all right; r3: 1 draft, right.
    target = [1, 2, 3] + [4] + [0, 1, 2, 3] + [2, 2]
    drafts = [0, 2, 9] + [9] + [0, 1, 2, 9] + [2, 9]  # 9 in bonus rows: ignored, out of range
    inp = _greedy_input(target, drafts, num_draft=[2, 0, 3, 1])
    for out in _both_paths(inp):
        assert out == VerifyOutput(num_accepted=[0, 0, 3, 1], next_token=[1, 4, 3, 2])


@pytest.mark.parametrize("has_draft_probs", [False, True])
def test_greedy_fast_path_agrees_with_general_path_on_random_batches(
    has_draft_probs: bool,
) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        num_draft = torch.randint(0, 5, (6,), generator=gen).tolist()
        num_rows = sum(num_draft) + len(num_draft)
        logits = torch.randn(num_rows, VOCAB_SIZE, generator=gen)
        is_copy = torch.rand(num_rows, generator=gen) < 0.7
        random_tokens = torch.randint(0, VOCAB_SIZE, (num_rows,), generator=gen)
        drafts = torch.where(is_copy, logits.argmax(-1), random_tokens)
        draft_probs = torch.softmax(torch.randn(num_rows, VOCAB_SIZE, generator=gen), -1)
        inp = VerifyInput(
            target_logits=logits,
            draft_tokens=drafts,
            draft_probs=draft_probs if has_draft_probs else None,
            num_draft=num_draft,
            temperature=[0.0] * 6,
            top_p=[1.0, 0.5, 1.0, 0.9, 1.0, 0.3],
            generators=[None] * 6,
        )
        fast, general = _both_paths(inp)
        assert fast == general


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_on_host_lists_matches_verify_with_ties_and_partial_matches(dtype: torch.dtype) -> None:
    """`verify_greedy` (the engine's CPU path for all-greedy batches) gives `verify`'s result: bf16 logits rounded
    to few values make equal maxima common (the first one wins in both), drafts copy the argmax 70 % of the time."""
    gen = torch.Generator().manual_seed(1)
    num_accepted = 0
    for _ in range(30):
        num_draft = torch.randint(0, 6, (7,), generator=gen).tolist()
        num_rows = sum(num_draft) + len(num_draft)
        logits = torch.randint(0, 4, (num_rows, VOCAB_SIZE), generator=gen).to(dtype)  # many ties
        is_copy = torch.rand(num_rows, generator=gen) < 0.7
        drafts = torch.where(is_copy, logits.float().argmax(-1), torch.randint(0, VOCAB_SIZE, (num_rows,),
                                                                                 generator=gen))
        per_request, row = [], 0
        for n in num_draft:
            per_request.append(drafts[row:row + n].tolist())
            row += n + 1
        expected = verify(VerifyInput(logits, drafts, None, num_draft, [0.0] * 7, [1.0] * 7, [None] * 7))
        assert verify_greedy(logits, per_request, num_draft) == expected
        num_accepted += sum(expected.num_accepted)
    assert num_accepted > 0  # drafts were accepted: the loop's matching path ran, not only its first rows


def test_greedy_on_host_lists_rejects_rows_that_do_not_fit_the_drafts() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        verify_greedy(torch.zeros(3, VOCAB_SIZE), [[1, 2]], [2, 0])


def _sampled_batch(seeds: list[int]) -> VerifyInput:
    gen = torch.Generator().manual_seed(42)
    num_draft = [3, 0, 4, 2]
    num_rows = sum(num_draft) + len(num_draft)
    return VerifyInput(
        target_logits=torch.randn(num_rows, 50, generator=gen),
        draft_tokens=torch.randint(0, 50, (num_rows,), generator=gen),
        draft_probs=torch.softmax(torch.randn(num_rows, 50, generator=gen), -1),
        num_draft=num_draft,
        temperature=[1.0, 0.8, 1.2, 1.0],
        top_p=[1.0, 0.9, 0.95, 1.0],
        generators=[torch.Generator().manual_seed(s) for s in seeds],
    )


def test_equal_seeds_give_equal_results() -> None:
    seeds = [1, 2, 3, 4]
    assert verify(_sampled_batch(seeds)) == verify(_sampled_batch(seeds))


def test_each_request_depends_only_on_its_own_generator() -> None:
    """Changing request 2's seed may change request 2 only."""
    outputs = [verify(_sampled_batch([1, 2, s, 4])) for s in range(10)]
    for out in outputs:
        for r in (0, 1, 3):
            assert out.num_accepted[r] == outputs[0].num_accepted[r]
            assert out.next_token[r] == outputs[0].next_token[r]
    assert len({(o.num_accepted[2], o.next_token[2]) for o in outputs}) > 1


def test_mixed_batch_keeps_greedy_semantics_and_accepts_drafts_equal_to_target() -> None:
    target_logits = _one_hot_logits([3, 1, 2] + [0, 4, 1, 2])
    # Request 1 (sampled) drafts from exactly the target distribution, so p/q = 1 and every
    # draft is accepted whatever the uniforms are.
    target_probs = logits_to_probs(target_logits, torch.ones(7), torch.ones(7))
    inp = VerifyInput(
        target_logits=target_logits,
        draft_tokens=torch.tensor([3, 0, 0] + [1, 0, 3, 0]),
        draft_probs=target_probs,
        num_draft=[2, 3],
        temperature=[0.0, 1.0],
        top_p=[1.0, 1.0],
        generators=[None, torch.Generator().manual_seed(0)],
    )
    out = verify(inp)
    assert out.num_accepted == [1, 3]
    assert out.next_token[0] == 1


def test_tokens_outside_the_nucleus_are_never_accepted_nor_emitted() -> None:
    # Token 0 holds 72% of the mass, so top-p 0.5 keeps it alone.
    num_requests = 200
    logits = torch.tensor([[3.0, 0.8, 0.7, 0.6, 0.5]]).repeat(2 * num_requests, 1)
    inp = VerifyInput(
        target_logits=logits,
        draft_tokens=torch.tensor([3, 0] * num_requests),
        draft_probs=None,
        num_draft=[1] * num_requests,
        temperature=[1.0] * num_requests,
        top_p=[0.5] * num_requests,
        generators=[torch.Generator().manual_seed(s) for s in range(num_requests)],
    )
    out = verify(inp)
    assert out.num_accepted == [0] * num_requests
    assert out.next_token == [0] * num_requests


def test_zero_residual_mass_falls_back_to_the_target() -> None:
    # q = 2p is not a distribution, but it makes max(0, p - q) vanish after a rejection
    # (acceptance prob 1/2), which must then emit from p: only tokens 1 and 2 have mass.
    num_requests = 100
    logits = torch.tensor([[-30.0, 1.0, 1.5, -30.0]]).repeat(2 * num_requests, 1)
    probs = logits_to_probs(logits, torch.ones(len(logits)), torch.ones(len(logits)))
    inp = VerifyInput(
        target_logits=logits,
        draft_tokens=torch.tensor([1, 0] * num_requests),
        draft_probs=2 * probs,
        num_draft=[1] * num_requests,
        temperature=[1.0] * num_requests,
        top_p=[1.0] * num_requests,
        generators=[torch.Generator().manual_seed(s) for s in range(num_requests)],
    )
    out = verify(inp)
    assert 0 < sum(out.num_accepted) < num_requests
    assert set(out.next_token) <= {1, 2}


def test_inconsistent_batch_shapes_are_rejected() -> None:
    inp = _greedy_input(target=[1, 2, 3], drafts=[1, 2, 3], num_draft=[1])
    with pytest.raises(ValueError, match="rows"):
        verify(inp)
    inp = _greedy_input(target=[1, 2], drafts=[1, 2], num_draft=[1])
    inp.top_p = [0.0]
    with pytest.raises(ValueError, match="top_p"):
        verify(inp)
