"""Sampled suffix drafts (T > 0): each step's q is the context's continuation distribution (its most
frequent `max_q` tokens, renormalised), the drawn tokens follow q, and emission and survival are read from
q's shape, never from the drawn token."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from dspark.models.drafters.base import DraftRequest, SparseQ
from dspark.models.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from dspark.models.drafters.suffix.index import RequestText, SuffixIndex, WalkParams, sample_batch
from dspark.spec.chi2 import ALPHA, chi_square_pvalue
from dspark.spec.source_calibration import SourceCalibration


def continuation_counts(docs: list[np.ndarray], context: list[int]) -> Counter:
    """Brute force: what follows `context` anywhere in `docs`."""
    out: Counter = Counter()
    m = len(context)
    for d in docs:
        for i in range(len(d) - m):
            if list(d[i:i + m]) == context:
                out[int(d[i + m])] += 1
    return out


def corpus_draws(index: SuffixIndex, context: list[int], params: WalkParams, uniforms: np.ndarray):
    text = RequestText()
    text.sync(context)
    n = len(uniforms)
    texts = [text] * n
    return sample_batch(texts, index, [None] * n, params, uniforms.shape[1], [1] * n, [0] * n, uniforms, None,
                        np.zeros(params.max_occurrences, dtype=np.int64))


def test_first_step_q_is_the_contexts_continuation_distribution_and_draws_follow_it():
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 5, size=int(rng.integers(5, 30))).astype(np.int32) for _ in range(60)]
    index = SuffixIndex.build(docs)
    params = WalkParams(min_ctx=2, max_ctx=2, min_path_prob=0.0, num_samples=64, max_q=16)
    context = [3, 1]
    truth = continuation_counts(docs, context)
    assert sum(truth.values()) <= 64  # an exact run: q is the counts themselves
    out = corpus_draws(index, context, params, rng.random((4000, 3), dtype=np.float32))
    assert (out.k[:4000] >= 1).all()
    q = {int(t): float(p) for t, p in zip(out.q_tokens[0, 0], out.q_probs[0, 0]) if t >= 0}
    total = sum(truth.values())
    assert q == pytest.approx({t: c / total for t, c in truth.items()}, abs=1e-6)
    assert out.freq[0, 0] == pytest.approx(max(q.values()))  # what the calibration reads: q's mode share
    drawn = Counter(out.tokens[:4000, 0].tolist())
    tokens = sorted(q)
    observed = torch.tensor([float(drawn[t]) for t in tokens])
    assert chi_square_pvalue(observed, torch.tensor([q[t] for t in tokens])) > ALPHA
    # each next step's q is the continuation distribution of the context extended by the drawn token
    checked = 0
    for r in range(20):
        first = int(out.tokens[r, 0])
        longer = continuation_counts(docs, context + [first])  # the walk keeps the whole matched context
        q2 = {int(t): float(p) for t, p in zip(out.q_tokens[r, 1], out.q_probs[r, 1]) if t >= 0}
        if out.k[r] >= 2:
            tot = sum(longer.values())
            assert q2 == pytest.approx({t: c / tot for t, c in longer.items()}, abs=1e-6), longer
            checked += 1
    assert checked > 10


def test_q_keeps_the_most_frequent_continuations_and_renormalises():
    docs = [np.array([9, 9, t], dtype=np.int32) for t in [1] * 6 + [2] * 3 + [3] * 2 + [4]]
    index = SuffixIndex.build(docs)
    params = WalkParams(min_ctx=2, max_ctx=2, min_path_prob=0.0, max_q=2)
    out = corpus_draws(index, [9, 9], params, np.full((1, 1), 0.99, dtype=np.float32))
    assert out.q_tokens[0, 0].tolist() == [1, 2] and out.q_probs[0, 0].tolist() == pytest.approx([6 / 9, 3 / 9])
    assert out.tokens[0, 0] == 2  # u = 0.99 lands in the last slot of q


def test_emission_stops_on_qs_shape_not_on_the_drawn_token():
    """With a path threshold, whether step 2 is emitted depends on q_1's mode share and q_2's, which are the
    same whichever token was drawn at step 1 when every continuation leads to the same spread."""
    docs = [np.array([5, 6, a, b], dtype=np.int32) for a in (1, 2) for b in (3, 4) for _ in range(5)]
    index = SuffixIndex.build(docs)
    params = WalkParams(min_ctx=2, max_ctx=2, min_path_prob=0.2, max_q=16)
    out = corpus_draws(index, [5, 6], params, np.random.default_rng(1).random((200, 3), dtype=np.float32))
    # q_1 = (1/2, 1/2), q_2 = (1/2, 1/2): path 0.5 then 0.25 ≥ 0.2, then the document ends
    assert set(out.k[:200].tolist()) == {2}
    assert set(out.tokens[:200, 0].tolist()) == {1, 2} and set(out.tokens[:200, 1].tolist()) == {3, 4}


def test_request_source_draws_from_its_own_text():
    text = RequestText()
    seq = [7, 1, 2, 7, 1, 3, 7, 1, 2, 7, 1]
    text.sync(seq)
    params = WalkParams(request_min_ctx=2, request_max_ctx=2, min_path_prob=0.0)
    uniforms = np.random.default_rng(2).random((3000, 1), dtype=np.float32)
    out = sample_batch([text] * 3000, None, [None] * 3000, params, 1, [0] * 3000, [0] * 3000, uniforms, None,
                       np.zeros(params.max_occurrences, dtype=np.int64))
    q = {int(t): float(p) for t, p in zip(out.q_tokens[0, 0], out.q_probs[0, 0]) if t >= 0}
    assert q == pytest.approx({2: 2 / 3, 3: 1 / 3})  # "7 1" was followed by 2, 3, 2
    drawn = Counter(out.tokens[:3000, 0].tolist())
    assert chi_square_pvalue(torch.tensor([float(drawn[2]), float(drawn[3])]), torch.tensor([2 / 3, 1 / 3])) > ALPHA


def dense(q: SparseQ, vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(len(q), vocab)
    q.write(out)
    return out


def test_drafter_draws_at_temperature_only_and_carries_q():
    docs = [np.array([4, 5, t, 8], dtype=np.int32) for t in [1] * 6 + [2] * 4]
    drafter = SuffixDrafter(SuffixIndex.build(docs), SourceCalibration(), SuffixConfig(sources=("corpus",)))
    greedy = drafter.propose([DraftRequest("g", [0, 4, 5], 0.0)], 2)
    assert greedy.tokens == [[1, 8]] and greedy.probs is None  # T = 0: the deterministic walk
    mixed = drafter.propose([DraftRequest("g", [0, 4, 5], 0.0), DraftRequest("s", [0, 4, 5], 1.0)], 2)
    assert mixed.probs is not None and len(mixed.probs) == 2
    assert all(isinstance(p, SparseQ) for p in mixed.probs)
    assert dense(mixed.probs[0]).tolist() == [[0, 1.0] + [0] * 8, [0] * 8 + [1.0, 0]]  # point masses at T = 0
    q = dense(mixed.probs[1])
    assert q.shape == (2, 10) and q[0, 1].item() == pytest.approx(0.6) and q[0, 2].item() == pytest.approx(0.4)
    assert q[1, 8].item() == pytest.approx(1.0) and q.sum(1).tolist() == pytest.approx([1.0, 1.0])
    assert drafter.last["s"].regime == "empirical" and drafter.last["g"].regime == "greedy"
    off = SuffixDrafter(SuffixIndex.build(docs), SourceCalibration(),
                        SuffixConfig(sources=("corpus",), empirical_q=False))
    assert off.propose([DraftRequest("s", [0, 4, 5], 1.0)], 2).probs is None


def test_verify_rows_hold_dense_and_sparse_q_for_verified_positions_only():
    from types import SimpleNamespace

    from dspark.verify_service.step.batch import build_verify_input

    reqs = [SimpleNamespace(params=SimpleNamespace(temperature=1.0, top_p=1.0), generator=None)] * 3
    dense_q = torch.softmax(torch.randn(3, 10), -1)
    sparse_q = SparseQ(np.array([[2, 5, -1], [7, -1, -1]]), np.array([[0.75, 0.25, 0.0], [1.0, 0, 0]], np.float32))
    lengths = [2, 1, 0]
    inp = build_verify_input(torch.zeros(sum(lengths) + 3, 10), reqs, [[1, 2, 3], [2, 7], []],  # type: ignore[arg-type]
                             [dense_q, sparse_q, SparseQ.point_masses([])], lengths)
    probs = inp.draft_probs
    assert probs is not None and probs.shape == (6, 10)
    assert torch.equal(probs[0:2], dense_q[:2]) and not probs[2].any()  # request 0: 2 verified, then its bonus row
    assert probs[3, 2].item() == 0.75 and probs[3, 5].item() == 0.25 and probs[3].sum().item() == pytest.approx(1.0)
    assert not probs[4:].any()  # request 1's bonus row (its second position is not verified), request 2's bonus
