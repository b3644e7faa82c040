"""The suffix proposer: its indexes walk what they should, its calibration fits, and the hybrid is lossless."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.config.engine import EngineConfig
from dspark.draft_service.client import RemoteDrafter
from dspark.draft_service.service import DraftService, serve_channel
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.dspark.drafter import DSparkDrafter
from dspark.models.drafters.hybrid import HybridDrafter
from dspark.models.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from dspark.models.drafters.suffix.index import (
    RequestText,
    SuffixIndex,
    WalkParams,
    build_suffix_array,
    concat_documents,
    propose_batch,
)
from dspark.spec.chi2 import ALPHA, chi_square_pvalue
from dspark.spec.source_calibration import SourceCalibration, feature_bins
from dspark.verify_service.engine import Engine
from dspark.verify_service.pipelined_engine import PipelinedEngine
from dspark.verify_service.request import SamplingParams
from tests.test_engine_lossless import hf_greedy, tiny_prompts
from tests.test_pipelined_engine import channel_pair
from tests.tiny import tiny_sps_path
from tests.tiny_drafters import make_dspark


def random_docs(seed: int, num_docs: int = 300, vocab: int = 12) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 40))).astype(np.int32) for _ in range(num_docs)]


# ---- the global index -----------------------------------------------------------------------------------
def test_suffix_array_sorts_every_position_by_its_following_tokens():
    docs = random_docs(0)
    text = concat_documents(docs)
    sa = build_suffix_array(text, depth=32)
    assert sorted(sa.tolist()) == [i for i in range(len(text)) if text[i] >= 0]  # every token once, no separator
    keys = [tuple(text[p:p + 32].tolist()) for p in sa]
    assert keys == sorted(keys)


def brute_next_counts(docs: list[np.ndarray], context: list[int]) -> Counter:
    counts: Counter = Counter()
    n = len(context)
    for d in docs:
        d = d.tolist()
        for s in range(len(d) - n):
            if d[s:s + n] == context:
                counts[d[s + n]] += 1
    return counts


def test_corpus_walk_takes_the_most_frequent_continuation_of_the_longest_context():
    docs = random_docs(1)
    index = SuffixIndex.build(docs)
    params = WalkParams(min_ctx=1, max_ctx=4, min_path_prob=0.0, num_samples=10_000)  # exact counting
    rng = np.random.default_rng(2)
    for _ in range(40):
        context = rng.integers(0, 12, size=6).astype(np.int32)
        walk = index.walk(context, 3, params)
        longest = next((n for n in range(4, 0, -1) if brute_next_counts(docs, context[-n:].tolist())), None)
        if longest is None:
            assert walk.tokens == []
            continue
        counts = brute_next_counts(docs, context[-longest:].tolist())
        top = max(counts.values())
        assert walk.match[0] == longest
        assert counts[walk.tokens[0]] == top  # a most frequent continuation
        assert walk.freq[0] == pytest.approx(top / sum(counts.values()) * sum(counts.values()) / walk.count[0])
        if len(walk.tokens) > 1:  # the walk goes on from the extended context
            nxt = brute_next_counts(docs, context[-longest:].tolist() + [walk.tokens[0]])
            assert nxt[walk.tokens[1]] == max(nxt.values()) and walk.match[1] == longest + 1


def test_a_batchs_walks_go_in_lockstep_and_each_is_its_own_walk():
    # more requests than one lockstep pass takes, contexts with and without matches, short ones, and a separator
    # (-1) inside: every corpus walk of the batch is the request's own single walk, which the brute force checks
    docs = random_docs(3)
    index = SuffixIndex.build(docs)
    params = WalkParams(min_ctx=1, max_ctx=5, min_path_prob=0.05, num_samples=8)  # large runs sampled
    rng = np.random.default_rng(4)
    contexts = [rng.integers(0, 14, size=int(rng.integers(1, 9))).astype(np.int32) for _ in range(70)]
    contexts[5][0] = -1
    texts = []
    for c in contexts:
        t = RequestText()
        t.sync(c.tolist())
        texts.append(t)
    out = propose_batch(texts, index, [None] * len(texts), params, 4, [(0, 0, 0)] * len(texts),
                        (True, True, False), None, np.zeros(params.max_occurrences, dtype=np.int64))
    for r, c in enumerate(contexts):
        batch_walk, single = out.walk(r, 1), index.walk(c, 4, params)
        assert batch_walk == single, r
        clean = c[(np.flatnonzero(c < 0)[-1] + 1) if (c < 0).any() else 0:]
        longest = next((n for n in range(min(5, len(clean)), 0, -1) if brute_next_counts(docs, clean[-n:].tolist())),
                       None)
        if single.tokens:
            assert single.match[0] == longest
    assert sum(bool(out.walk(r, 1).tokens) for r in range(len(contexts))) > 20  # most of them walked somewhere


def test_a_drafter_asked_for_fewer_tokens_round_after_round_keeps_its_buffers_bounded():
    # rounds near a request's token limit ask for fewer tokens (7, 6, 5, ...): each change of max_tokens reallocates
    # the batch's buffers, which must keep their capacity, not double it (it did: 24 GiB after 30 changes)
    index = SuffixIndex.build(random_docs(3))
    drafter = SuffixDrafter(index, config=SuffixConfig(sources=("request", "corpus")))
    rng = np.random.default_rng(5)
    reqs = [DraftRequest(f"r{i}", rng.integers(0, 14, size=12).tolist(), 0.0) for i in range(3)]
    for k in [7, 6, 5, 4, 3, 2, 1] * 6:
        drafter.choose_batch(reqs, k)
        assert drafter._batch.max_tokens == k and drafter._batch.num_requests == 8
    wide = reqs * 4  # 12 requests: grown once, to what they need
    drafter.choose_batch(wide, 7)
    assert drafter._batch.num_requests == 16
    for k in (3, 7, 2, 7):
        drafter.choose_batch(wide, k)
        assert drafter._batch.num_requests == 16
    sampled = [DraftRequest(r.request_id, r.token_ids, 1.0) for r in reqs]
    for k in [7, 5, 3, 1] * 6:  # the sampled walks' buffers alike
        drafter.choose_batch(sampled, k)
        assert drafter._sampled is not None and drafter._sampled.num_requests == 8


def test_large_runs_are_sampled_but_the_winner_is_counted_exactly():
    docs = [np.array([1, 2, 3], dtype=np.int32)] * 600 + [np.array([1, 2, 4], dtype=np.int32)] * 400
    index = SuffixIndex.build(docs)
    walk = index.walk(np.array([7, 1, 2], dtype=np.int32), 1, WalkParams(min_ctx=2, num_samples=16))
    assert walk.tokens == [3] and walk.freq[0] == pytest.approx(0.6) and walk.count[0] == 1000


def test_request_walk_is_prompt_lookup_with_frequencies():
    text = RequestText()
    text.sync([1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2])
    walk = text.walk(3, WalkParams(min_path_prob=0.0))
    # "5 1 2" never occurred before; "1 2" did three times, followed by 3, 4, 3
    assert walk.tokens[0] == 3 and walk.freq[0] == pytest.approx(2 / 3) and walk.count[0] == 3
    assert walk.match[0] == 2
    # after "1 2 3": 1 once and 5 once; the tie goes to the most recent occurrence
    assert walk.tokens[1] == 5 and walk.freq[1] == pytest.approx(0.5) and walk.count[1] == 2
    text.sync([1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2, 9])  # grows by its tail only
    assert text.tokens().tolist()[-2:] == [2, 9]


def _request_first_step(seq: list[int], min_ctx: int, max_ctx: int, max_occ: int) -> tuple[int, int, int, float]:
    """Prompt lookup by its definition: the longest suffix (max_ctx .. min_ctx tokens) that occurred earlier
    with a next token; its most recent `max_occ` occurrences; their most frequent next token (ties: the most
    recent). (match, count, token, freq); match 0 where nothing occurred."""
    n = len(seq)
    for length in range(min(max_ctx, n - 1), max(min_ctx, 1) - 1, -1):
        nexts = [seq[s + length] for s in range(n - length - 1, -1, -1) if seq[s:s + length] == seq[n - length:]]
        nexts = nexts[:max_occ]
        if nexts:
            counts = Counter(nexts)
            best = max(counts.values())
            token = next(t for t in nexts if counts[t] == best)
            return length, len(nexts), token, best / len(nexts)
    return 0, 0, -1, 0.0


@pytest.mark.parametrize("max_ctx", [3, 8, 16])
def test_request_walk_takes_the_longest_earlier_context_up_to_max_ctx(max_ctx):
    rng = np.random.default_rng(max_ctx)
    for trial in range(300):
        seq = rng.integers(0, int(rng.integers(2, 8)), size=int(rng.integers(2, 60))).tolist()
        if trial % 3 == 0:  # a repeated stretch: long matches
            seq = seq + seq[:int(rng.integers(1, len(seq) + 1))]
        params = WalkParams(request_min_ctx=1, request_max_ctx=max_ctx, min_path_prob=0.0,
                            max_occurrences=int(rng.integers(1, 12)))
        text = RequestText()
        text.sync(seq)
        walk = text.walk(1, params)
        match, count, token, freq = _request_first_step(seq, 1, max_ctx, params.max_occurrences)
        if match == 0:
            assert walk.tokens == []
            continue
        assert (walk.match[0], walk.count[0], walk.tokens[0]) == (match, count, token), seq
        assert walk.freq[0] == pytest.approx(freq)


def _build_in(root: str, seed: int) -> int:
    index = SuffixIndex.cached(random_docs(seed), root=Path(root))
    return int(index.sa.sum())


def test_concurrent_builders_publish_one_index_that_later_starts_load(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(3) as pool:
        sums = pool.starmap(_build_in, [(str(tmp_path), 5)] * 3)
    assert len(set(sums)) == 1
    folders = [p for p in tmp_path.iterdir()]
    assert len(folders) == 1 and not folders[0].name.endswith(".tmp")  # one published, no leftovers
    assert int(SuffixIndex.cached(random_docs(5), root=tmp_path).sa.sum()) == sums[0]


# ---- calibration ----------------------------------------------------------------------------------------
def test_binned_calibration_recovers_the_acceptance_rate_per_cell_and_round_trips(tmp_path):
    rng = np.random.default_rng(3)
    cal = SourceCalibration()
    truth = {0.25: 0.1, 0.95: 0.8}  # the source's frequency says little about acceptance: calibration must learn it
    for _ in range(4000):
        f = float(rng.choice(list(truth)))
        accepted = int(rng.random() < truth[f])
        cal.record("corpus", "greedy", [f], [8], [4], 1, accepted)
    got = cal.conditional("corpus", "greedy", [0.25, 0.95], [8, 8], [4, 4])
    assert got[0] == pytest.approx(0.1, abs=0.03) and got[1] == pytest.approx(0.8, abs=0.03)
    assert cal.conditional("corpus", "sampled", [0.95], [8], [4]) == [0.95]  # no sampled-regime data: raw frequency
    cal.save(tmp_path / "c.json")
    assert SourceCalibration.load(tmp_path / "c.json").conditional("corpus", "greedy", [0.25], [8], [4]) == [got[0]]
    assert feature_bins(1.0, 1, 1, 1) == (9, 0, 0, 0) and feature_bins(0.0, 100, 20, 9) == (0, 6, 5, 3)


def test_the_prefix_survival_scaling_is_fitted_bin_by_bin_and_round_trips(tmp_path):
    """Tables whose c_k are too sharp and too high (true survival σ(logit(c) / 1.5 − 0.3)): the scaling finds
    the temperature and shift of the first bin, and leaves each position's prefix survival a_k unbiased."""
    from dspark.spec.source_calibration import _shifted, fit_scaling

    rng = np.random.default_rng(11)
    conds, verified, accepted = [], [], []
    for _ in range(6000):
        c = rng.uniform(0.2, 0.97, size=7)
        true = 1 / (1 + np.exp(-(np.log(c / (1 - c)) / 1.5 - 0.3)))
        n = 0
        while n < 7 and rng.random() < true[n]:
            n += 1
        conds.append(c.tolist())
        verified.append(7)
        accepted.append(n)
    params = fit_scaling(conds, verified, accepted)
    assert params[0][0] == pytest.approx(1.5, abs=0.15) and params[0][1] == pytest.approx(-0.3, abs=0.1)
    bins = [min(k, 3) for k in range(7)]
    scaled = [_shifted(c, None, params, bins) for c in conds]
    bias_before, bias_after = [], []
    for k in range(7):
        observed = np.mean([n > k for n in accepted])
        bias_before.append(np.mean([np.prod(c[:k + 1]) for c in conds]) - observed)
        bias_after.append(np.mean([np.prod(c[:k + 1]) for c in scaled]) - observed)
    assert max(map(abs, bias_after)) < 0.02 < abs(bias_before[0]), (bias_before, bias_after)
    cal = SourceCalibration(scaling={("corpus", "greedy"): params})
    cal.save(tmp_path / "c.json")
    assert SourceCalibration.load(tmp_path / "c.json").scaling == {("corpus", "greedy"): params}


def test_preferred_replays_the_choice_rule_on_the_rounds_walks():
    """The most expected accepted tokens Σ_k Π c_i wins; a tie goes to the earlier source (suffix_kernels.c)."""
    from dspark.training.suffix_calibrate import preferred

    cal = SourceCalibration()  # no tables: c_k is the walk's frequency
    strong, weak = ([0.9] * 3, [4] * 3, [3] * 3), ([0.2] * 3, [4] * 3, [2] * 3)
    alts = (("request", *strong), ("corpus", *weak))
    assert preferred(cal, ("request", "greedy", *strong, 3, 1, alts))
    assert not preferred(cal, ("corpus", "greedy", *weak, 3, 1, alts))
    assert preferred(cal, ("corpus", "greedy", *weak, 3, 1, (("corpus", *weak),)))  # alone: picked
    tie = (("request", *weak), ("served", *weak))
    assert preferred(cal, ("request", "greedy", *weak, 3, 1, tie)) and not preferred(cal, ("served", "greedy", *weak,
                                                                                          3, 1, tie))


def test_the_scaling_is_fitted_where_the_choice_rule_picks_a_source_and_undoes_the_winners_curse():
    """Two sources whose estimates read the same context ease through independent noise, calibrated on every
    explore round: where a source WINS the choice its estimate was optimistic (the winner's curse), so on the
    rounds the scheduler reads its survival is over-confident. The scaling fitted on the picked rounds brings
    that survival to its acceptance; one fitted on every round would not."""
    from dspark.spec.source_calibration import fit_scaling
    from dspark.training.suffix_calibrate import RoundLog, fit_scalings, heldout_ece, preferred

    rng = np.random.default_rng(5)
    sources = ("corpus", "served")

    def rounds(n: int) -> list[tuple]:
        rows = []
        for i in range(n):
            ease = rng.normal(0.3, 1.2)
            est = {s: float(1 / (1 + np.exp(-(ease + rng.normal(0.0, 1.0))))) for s in sources}
            src = sources[i % 2]  # explore: the sources take turns
            accepted = 0
            while accepted < 3 and rng.random() < 1 / (1 + np.exp(-ease)):
                accepted += 1
            alts = tuple((s, [est[s]] * 3, [8] * 3, [4] * 3) for s in sources)
            rows.append((src, "greedy", [est[src]] * 3, [8] * 3, [4] * 3, 3, accepted, alts))
        return rows

    cal = SourceCalibration()
    for r in rounds(20000):  # the tables: every explore round
        cal.record(*r[:7])
    scale, held = RoundLog(rounds(8000)), RoundLog(rounds(8000))

    def served_bias(c: SourceCalibration, rows: list[tuple]) -> float:
        """Mean a_1 the served source's picked rounds carried, minus their share of accepted first tokens."""
        picked = [r for r in rows if r[0] == "served" and preferred(c, r)]
        return float(np.mean([c.conditional(*r[:5])[0] for r in picked]) - np.mean([r[6] > 0 for r in picked]))

    assert served_bias(cal, held.rows) > 0.04  # the tables alone: over-confident where served wins
    everywhere = SourceCalibration(cal.tables, {("served", "greedy"): fit_scaling(
        [cal.conditional(*r[:5]) for r in scale.rows if r[0] == "served"],
        [r[5] for r in scale.rows if r[0] == "served"], [r[6] for r in scale.rows if r[0] == "served"])})
    assert served_bias(everywhere, held.rows) > 0.03  # a scaling of every round keeps the curse
    before = heldout_ece(cal, held.picked(cal), 3)["greedy"]["served"]["ece_mean_over_positions"]
    report = fit_scalings(cal, scale, held, 3)
    assert report["served/greedy"]["kept"] and report["served/greedy"]["num_rounds"] < 4000  # picked rounds only
    assert abs(served_bias(cal, held.rows)) < 0.02
    assert heldout_ece(cal, held.picked(cal), 3)["greedy"]["served"]["ece_mean_over_positions"] < before


def test_frozen_cells_are_the_estimates_cell_by_cell():
    rng = np.random.default_rng(8)
    cal = SourceCalibration()
    for _ in range(3000):
        f, n, m = float(rng.random()), int(rng.integers(1, 80)), int(rng.integers(1, 12))
        cal.record("corpus", "greedy", [f, f], [n, n], [m, m], 2, int(rng.integers(0, 3)))
    table = cal.table("corpus", "greedy")
    assert table is not None
    table.freeze()
    cells = [(f, n, m, k) for f in range(10) for n in range(7) for m in range(6) for k in range(4)]
    assert [table.lookup(c) for c in cells] == [table.estimate(c) for c in cells]  # the same floats


# ---- the hybrid in the engine ---------------------------------------------------------------------------
def self_distilled_docs(target, prompts: list[list[int]], num_new: int, temperature: float) -> list[np.ndarray]:
    """The tiny target's own continuations of `prompts` (prompt + response, as the index holds them)."""
    engine = Engine(EngineConfig(target=str(target.path), drafter="none", max_num_seqs=16, max_model_len=512),
                    target=target)
    reqs = engine.generate(prompts, [SamplingParams(max_tokens=num_new, temperature=temperature, seed=i,
                                                    ignore_eos=True) for i in range(len(prompts))])
    return [np.array(p + r.output_ids, dtype=np.int32) for p, r in zip(prompts, reqs)]


def make_hybrid(target, docs: list[np.ndarray], model_ratio: float = 0.0) -> HybridDrafter:
    suffix = SuffixDrafter(SuffixIndex.build(docs), SourceCalibration(), SuffixConfig())
    model = DSparkDrafter(make_dspark(target), target)
    return HybridDrafter(suffix, model, model_cost_ratio=model_ratio)


@contextmanager
def hybrid_engine(mode: str, cfg: EngineConfig, target, hybrid: HybridDrafter) -> Iterator[Engine]:
    """colocated: the hybrid inside the engine; decoupled: the hybrid behind a DraftService on the far end of a
    gloo pair, drafting for a pipelined engine through a RemoteDrafter (the decoupled pools' data path)."""
    if mode == "colocated":
        yield Engine(cfg, target=target, drafter=hybrid)
        return
    verify_end, draft_end = channel_pair()
    server = threading.Thread(target=serve_channel, args=(draft_end, DraftService(hybrid)), daemon=True)
    server.start()
    try:
        remote = RemoteDrafter(verify_end, hybrid.hidden_layers, name="hybrid")
        yield PipelinedEngine(cfg, target=target, drafter=remote)
    finally:
        verify_end.send({"kind": "close"})
        server.join(timeout=30)


def count_fed_features(hybrid: HybridDrafter) -> Counter[str]:
    """From now on, how many times each request's features reach the hybrid's DSpark (`observe` calls)."""
    fed: Counter[str] = Counter()
    observe = hybrid.feature_drafter.observe  # type: ignore[union-attr]

    def counting(request_id: str, features: torch.Tensor) -> None:
        fed[request_id] += 1
        observe(request_id, features)

    hybrid.feature_drafter.observe = counting  # type: ignore[union-attr, method-assign]
    return fed


def source_counts(engine: Engine) -> dict[str, list[int]]:
    """Per source, from the engine's step records: [chosen drafts, verified tokens, accepted tokens]."""
    out: dict[str, list[int]] = {}
    for s in engine.stats:
        for source, n_ver, n_acc in zip(s.sources or [], s.lengths, s.num_accepted):
            if source:
                c = out.setdefault(source, [0, 0, 0])
                c[0], c[1], c[2] = c[0] + 1, c[1] + n_ver, c[2] + n_acc
    return out


@pytest.mark.parametrize(("mode", "scheduler"), [("colocated", "fixed"), ("colocated", "greedy"),
                                                 ("colocated", "async"), ("decoupled", "greedy")])
def test_hybrid_greedy_speculation_equals_hf_generate(tiny_target, mode, scheduler):
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:16]
    refs = [hf_greedy(tiny_target, p, 32) for p in prompts]
    docs = self_distilled_docs(tiny_target, tiny_prompts(tiny_target.model.config.vocab_size)[16:], 48, 0.0)
    hybrid = make_hybrid(tiny_target, docs)
    cfg = EngineConfig(target=str(tiny_target.path), drafter="hybrid", scheduler=scheduler,
                       scheduler_kwargs={"k": 5} if scheduler == "fixed" else {}, num_draft_tokens=7, max_num_seqs=8,
                       max_model_len=512, sps_profile=tiny_sps_path(tiny_target.path), draft_gate=False)
    with hybrid_engine(mode, cfg, tiny_target, hybrid) as engine:
        reqs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.output_ids for r in reqs] == refs
    counts = source_counts(engine)
    assert counts.get("dspark", [0])[0] > 0 and counts.get("request", [0])[0] + counts.get("corpus", [0])[0] > 0
    assert sum(r.num_accepted for r in reqs) > 0
    # the verify side's verdicts reach the drafter (in decoupled mode, riding on the next draft message)
    stats = hybrid.source_stats()
    assert stats["dspark"]["num_verified"] > 0 and stats["request"]["num_verified"] + stats["corpus"]["num_verified"]
    # every request released (remotely, releases ride on the next message: the last ones never leave)
    assert not hybrid.suffix._texts if mode == "colocated" else len(hybrid.suffix._texts) <= 8


@pytest.mark.parametrize("mode", ["colocated", "decoupled"])
def test_where_drafting_does_not_pay_the_hybrid_forgoes_dspark_features_and_decodes_the_same(tiny_target, mode):
    """A draft gate that measured drafting losing at batch 8 (a real gate, told so by rounds through its API): the
    engine stops tapping the target for the hybrid (its prompt features are the last DSpark sees; decoupled: the
    far side hears of it with the next message, before that message's features), DSpark drafts none of those
    requests, and greedy output is still target-only's."""
    from dspark.spec.draft_gate import DraftGate
    from dspark.spec.sps import SPSTable

    vocab = tiny_target.model.config.vocab_size
    prompts = tiny_prompts(vocab)[:8]
    refs = [hf_greedy(tiny_target, p, 24) for p in prompts]
    hybrid = make_hybrid(tiny_target, self_distilled_docs(tiny_target, tiny_prompts(vocab)[16:], 48, 0.0))
    fed = count_fed_features(hybrid)
    cfg = EngineConfig(target=str(tiny_target.path), drafter="hybrid", scheduler="greedy", num_draft_tokens=7,
                       max_num_seqs=8, max_model_len=512, sps_profile=tiny_sps_path(tiny_target.path))
    gate = DraftGate()
    sps = SPSTable.from_file(tiny_sps_path(tiny_target.path))
    for _ in range(4):  # drafted rounds at batch 8 that took 10x their verify forward and accepted nothing
        gate.record(8, 8, 0, round_ms=100.0, verify_ms=10.0, sps=sps)
    assert gate.is_shut(8) and gate.is_shut(12) and not gate.is_shut(4)  # larger sizes inherit; smaller: unknown
    with hybrid_engine(mode, cfg, tiny_target, hybrid) as engine:
        engine.set_draft_gate(gate)
        reqs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        assert [r.output_ids for r in reqs] == refs
        assert "dspark" not in source_counts(engine)
        assert not engine._forgone  # released with their requests
    # the prompt's features, then none (decoupled: the prompt's ride with the message that says so, unobserved)
    assert all(fed[r.request_id] == (1 if mode == "colocated" else 0) for r in reqs), fed
    assert mode == "decoupled" or (not hybrid._forgone and not hybrid.feature_drafter._contexts)  # type: ignore


@pytest.mark.parametrize("mode", ["colocated", "decoupled"])
def test_where_dspark_adds_nothing_the_hybrid_stops_taking_its_features_and_decodes_the_same(tiny_target, mode):
    """A random DSpark (its drafts are rejected) is chosen at first (its prior); its account (tokens beyond the
    cheap drafts' expectation, less its forward and features) turns negative, the features gate closes, and the
    requests that come after it go without features (not even their prompt's) except one in _EXPLORE_EVERY;
    greedy output is target-only's throughout."""
    from dspark.models.drafters.hybrid import _EXPLORE_EVERY

    vocab = tiny_target.model.config.vocab_size
    prompts = tiny_prompts(vocab)[:16]
    refs = {tuple(p): hf_greedy(tiny_target, p, 24) for p in prompts}
    hybrid = make_hybrid(tiny_target, self_distilled_docs(tiny_target, tiny_prompts(vocab)[16:], 48, 0.0))
    fed = count_fed_features(hybrid)
    cfg = EngineConfig(target=str(tiny_target.path), drafter="hybrid", scheduler="greedy", num_draft_tokens=7,
                       max_num_seqs=4, max_model_len=512, sps_profile=tiny_sps_path(tiny_target.path),
                       draft_gate=False)
    with hybrid_engine(mode, cfg, tiny_target, hybrid) as engine:
        first = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        assert "dspark" in source_counts(engine)  # chosen while its account was open
        assert not hybrid.features_pay and hybrid._value_ms < 0
        later = engine.generate(prompts * 2, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.output_ids for r in first + later] == [refs[tuple(p)] for p in prompts * 3]
    fed_later = [fed[r.request_id] for r in later]
    explorers = sum(1 for n in fed_later if n > 2)
    assert 1 <= explorers <= len(later) // _EXPLORE_EVERY + 1, fed_later
    assert fed_later.count(0) == len(later) - explorers, fed_later


def test_dspark_features_pay_again_when_its_drafts_are_accepted_beyond_the_cheap_sources(tiny_target):
    """The features gate follows DSpark's account both ways: rounds where DSpark's drafts were accepted well
    beyond what the cheap drafts promised reopen it, and new requests keep their features again (a request
    declined meanwhile stays without: its DSpark context would have a gap)."""
    hybrid = make_hybrid(tiny_target, [np.arange(64, dtype=np.int32)])
    for _ in range(80):  # chosen, nothing accepted, its forward costing 1 ms of a 10 ms round
        hybrid._open_round = (time.perf_counter() - 0.01, 1.0, 1)
        hybrid._chosen_free["a"] = 0.5
        hybrid.feedback(["a"], [3], [0])
    assert not hybrid.features_pay
    assert [hybrid.wants_features(f"x{i}") for i in range(32)].count(True) == 2  # the explorers
    # a declined request is forgone at once: DSpark never drafts it (decoupled, its features were never observed)
    from types import SimpleNamespace

    cheap = [SimpleNamespace(expected_tokens=0.0)]
    assert hybrid._choose_model(cheap, [DraftRequest("x0", [1, 2, 3], 0.0)])[0] == [False]  # type: ignore[arg-type]
    assert hybrid._choose_model(cheap, [DraftRequest("x15", [1, 2, 3], 0.0)])[0] == [True]  # type: ignore[arg-type]
    for _ in range(80):  # now 4 tokens beyond the cheap drafts' 0.5 a round: ~8 ms of the round's time gained
        hybrid._open_round = (time.perf_counter() - 0.01, 1.0, 1)
        hybrid._chosen_free["a"] = 0.5
        hybrid.feedback(["a"], [5], [4])
    assert hybrid.features_pay and hybrid.wants_features("y") and not hybrid.wants_features("x0")  # once forgone


def test_a_draft_worker_whose_hybrid_declines_a_new_request_drafts_it_from_the_cheap_sources(tiny_target):
    """Decoupled, the account closed: a new request's first message carries its prompt features; the draft
    service hands none to DSpark (declined), the hybrid drafts it from its cheap sources (DSpark, without a
    context, must not be chosen: it would fail), and the reply names it for the verify side to forgo."""
    vocab = tiny_target.model.config.vocab_size
    hybrid = make_hybrid(tiny_target, self_distilled_docs(tiny_target, tiny_prompts(vocab)[16:], 48, 0.0))
    hybrid._value_rounds, hybrid._value_ms = 100.0, -50.0  # DSpark's account: closed
    service = DraftService(hybrid)
    prompt = tiny_prompts(vocab)[0]
    width = len(hybrid.hidden_layers) * tiny_target.model.config.hidden_size
    message = {"kind": "draft", "seq": 0, "max_num_tokens": 4, "released": [], "forgone": [], "verdicts": [],
               "requests": [{"id": "r", "new_tokens": prompt, "temperature": 0.0, "num_features": len(prompt)}],
               "features": torch.zeros(len(prompt), width)}
    reply = service.handle(message)
    assert reply["declined"] == ["r"] and reply["sources"] != ["dspark"] and "r" not in service._unusable
    assert "r" in hybrid._forgone and "r" not in hybrid.feature_drafter._contexts  # type: ignore[union-attr]


def test_hybrid_learns_dspark_acceptance_apart_where_the_cheap_sources_have_little(tiny_target):
    """DSpark's verdicts are kept per band of the cheap sources' expectation E_c: where it was chosen and lost
    (E_c ~ 0) it stops being chosen, while a band it has no verdicts in keeps the prior."""
    from types import SimpleNamespace

    hybrid = make_hybrid(tiny_target, [np.arange(64, dtype=np.int32)], model_ratio=0.1)
    requests = [DraftRequest("a", [1, 2, 3], 0.0), DraftRequest("b", [1, 2, 4], 0.0)]
    cheap = [SimpleNamespace(expected_tokens=0.0), SimpleNamespace(expected_tokens=0.3)]  # bands 0 and 1
    chosen, keys = hybrid._choose_model(cheap, requests)  # type: ignore[arg-type]
    assert chosen == [True, True] and keys == [("greedy", 0), ("greedy", 1)]
    for _ in range(40):  # chosen at E_c ~ 0 and verified, nothing accepted
        hybrid._chosen_model["a"] = keys[0]
        hybrid.feedback(["a"], [3], [0])
    # alone in a step (a forward costs a tenth of a round): not worth it at E_c ~ 0 any more, still at E_c 0.3
    assert hybrid._choose_model(cheap[:1], requests[:1])[0] == [False]  # type: ignore[arg-type]
    assert hybrid._choose_model(cheap[1:], requests[1:])[0] == [True]  # type: ignore[arg-type]
    assert hybrid.source_stats()["dspark"]["num_verified"] == 120


def pit_counts(target, prefixes: list[list[int]], tokens: list[int], rng: np.random.Generator,
               num_bins: int = 20) -> torch.Tensor:
    """Randomised probability integral transform of each token under the target's T=1 distribution after its
    prefix: uniform on [0, 1) exactly when the tokens follow the target. Returns bin counts."""
    counts = torch.zeros(num_bins)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prefixes):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        with torch.inference_mode():
            logits = target.model(torch.tensor([prefixes[i] for i in idx])).logits[:, -1].float()
        probs = torch.softmax(logits, -1)
        cdf = torch.cumsum(probs, -1) - probs
        for row, i in enumerate(idx):
            u = float(cdf[row, tokens[i]]) + rng.random() * float(probs[row, tokens[i]])
            counts[min(num_bins - 1, int(u * num_bins))] += 1
    return counts


@pytest.mark.parametrize(("mode", "empirical_q"), [("colocated", True), ("decoupled", True), ("colocated", False)])
def test_hybrid_sampled_tokens_follow_the_target_distribution(tiny_target, mode, empirical_q):
    """T = 1, 3,000 requests of one prompt, 4 tokens each; every token after the first comes out of a
    verification round whose draft is drawn from its cheap source's q (request or corpus source; with
    `empirical_q` off, their deterministic walk as a point mass) or DSpark's sample, mixed in one batch.
    Positions 2-4 are checked by a chi-square on the PIT bins: 3 tests at ALPHA = 1e-4, so a lossless engine
    fails with probability <= 3e-4 per case (fixed seeds: the outcome is deterministic)."""
    prompt = tiny_prompts(tiny_target.model.config.vocab_size)[1][:12]
    docs = self_distilled_docs(tiny_target, [prompt] * 64, 6, 1.0)
    hybrid = make_hybrid(tiny_target, docs)
    hybrid.suffix.config.empirical_q = empirical_q
    # fixed k: every drafted token is verified (a load-aware scheduler would skip the random DSpark's drafts)
    cfg = EngineConfig(target=str(tiny_target.path), drafter="hybrid", scheduler="fixed", scheduler_kwargs={"k": 3},
                       num_draft_tokens=4, max_num_seqs=64, max_model_len=64, prefix_cache_mb=0)
    with hybrid_engine(mode, cfg, tiny_target, hybrid) as engine:
        reqs = engine.generate([prompt] * 3000, [SamplingParams(max_tokens=4, temperature=1.0, seed=10_000 + i,
                                                                ignore_eos=True) for i in range(3000)])
    counts = source_counts(engine)
    assert counts["dspark"][1] > 0 and counts["corpus"][2] > 0  # both kinds of draft verified and used
    # the cheap drafts' verdicts were recorded (live calibration) under the regime they were drafted in
    assert set(hybrid.suffix.calibration.tables) == ({"empirical"} if empirical_q else {"sampled"})
    rng = np.random.default_rng(0)
    for pos in (1, 2, 3):
        prefixes = [prompt + r.output_ids[:pos] for r in reqs]
        pit = pit_counts(tiny_target, prefixes, [r.output_ids[pos] for r in reqs], rng)
        assert chi_square_pvalue(pit, torch.full((20,), 1 / 20)) > ALPHA, f"position {pos + 1}: {pit}"


@pytest.mark.parametrize("scaled", [False, True])
def test_native_walks_read_the_same_calibration_cells_as_python(scaled):
    """The C walk bins (f, n, m, k) itself to read c_k: it must pick the cell Python's `feature_bins` picks, and
    see the prefix-survival scaling of that cell's position bin."""
    rng = np.random.default_rng(4)
    cal = SourceCalibration()
    if scaled:
        cal.scaling[("corpus", "greedy")] = [(1.3, -0.2), (0.8, 0.1), (1.0, 0.3), (2.0, -0.5)]
    for _ in range(20_000):  # a distinct rate in many cells
        f, n, m, k = float(rng.random()), int(rng.integers(1, 80)), int(rng.integers(1, 12)), int(rng.integers(1, 8))
        cal.record("corpus", "greedy", [f] * k, [n] * k, [m] * k, k, k - 1 if rng.random() < f else 0)
    cal.record("request", "greedy", [0.5], [1], [1], 1, 1)
    docs = random_docs(6, num_docs=2000, vocab=6)
    index = SuffixIndex.build(docs)
    drafter = SuffixDrafter(index, cal, SuffixConfig(walk=WalkParams(min_path_prob=0.0)))
    reqs = [DraftRequest(f"r{i}", rng.integers(0, 6, size=30).tolist(), 0.0) for i in range(50)]
    checked = 0
    for p in drafter.choose_batch(reqs, 7):
        if p is None:
            continue
        w = p.walk
        expected = cal.conditional(p.source, "greedy", w.freq, w.count, w.match)
        assert w.conf == pytest.approx(expected, rel=1e-6)
        checked += len(w.conf)
    assert checked > 100


def test_live_calibration_follows_the_outcomes_of_verified_proposals():
    """Survival learned from the deployment's own verdicts (past rounds only): a source whose drafts are always
    rejected sees its survival fall after the next refresh."""
    docs = [np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)] * 50
    config = SuffixConfig(sources=("corpus",), live_refresh_every=64)
    drafter = SuffixDrafter(SuffixIndex.build(docs), SourceCalibration(), config)
    req = DraftRequest("r", [9, 1, 2], 0.0)
    first = drafter.propose([req], 3)
    assert first.tokens == [[3, 4, 5]] and first.confidences[0][0] > 0.9  # uncalibrated: the raw frequency
    for _ in range(100):
        drafter.propose([req], 3)
        drafter.feedback(["r"], [3], [0])  # every first token rejected
    later = drafter.propose([req], 3)
    assert later.tokens == first.tokens and later.confidences[0][0] < 0.1


def test_a_shifts_re_read_keeps_the_counts_of_the_last_refresh():
    """Between refreshes the verdicts' counts wait (a re-freeze costs ~2.5 ms a table): a re-read of the cells
    because the live shift moved applies the new shift to the tables as last frozen, and the refresh takes the
    counts in."""
    docs = [np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)] * 50
    config = SuffixConfig(sources=("corpus",), live_refresh_every=60, live_bias_rate=0.05)
    drafter = SuffixDrafter(SuffixIndex.build(docs), SourceCalibration(), config)
    req = DraftRequest("r", [9, 1, 2], 0.0)
    drafter.propose([req], 3)
    for _ in range(19):  # 19 outcomes (each verdict: position 1 tried and rejected): below the refresh
        drafter.feedback(["r"], [3], [0])
        drafter.propose([req], 3)
    cal, w = drafter.calibration, drafter.last["r"].walk
    frozen = cal.conditional("corpus", "greedy", w.freq, w.count, w.match, refreeze=False)
    assert w.conf == pytest.approx(frozen, abs=1e-6)  # the shift moved every round: re-read, not re-frozen
    assert cal.table("corpus", "greedy")._dirty
    fresh = cal.conditional("corpus", "greedy", w.freq, w.count, w.match)  # refreezes: the counts in
    assert fresh[0] < frozen[0] - 0.05
    for _ in range(60):  # past the refresh: the walk reads the counts
        drafter.feedback(["r"], [3], [0])
        drafter.propose([req], 3)
    w = drafter.last["r"].walk
    assert w.conf[0] == pytest.approx(cal.conditional("corpus", "greedy", w.freq, w.count, w.match)[0], abs=0.05)


def test_the_live_shift_brings_an_overconfident_sources_survival_to_its_acceptance_and_back():
    """Shipped tables that read 0.9 for a first token this traffic accepts half the time (thousands of shipped
    trials, so the added counts alone barely move them): the live log-odds shift brings the survival to about
    0.5 within a few thousand verdicts (~30 rounds of a batch of 32), and follows the traffic back up when it
    changes."""
    docs = [np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)] * 50
    walk = SuffixIndex.build(docs).walk(np.array([9, 1, 2], dtype=np.int32), 3, WalkParams())
    shipped = SourceCalibration()
    for _ in range(20_000):  # position 1 survives 90 % of the time in the shipped data
        shipped.record("corpus", "greedy", walk.freq, walk.count, walk.match, 1, int(np.random.rand() < 0.9))
    rng = np.random.default_rng(0)

    def run(drafter: SuffixDrafter, acceptance: float, rounds: int) -> float:
        for _ in range(rounds):
            drafter.propose([DraftRequest("r", [9, 1, 2], 0.0)], 3)
            drafter.feedback(["r"], [1], [int(rng.random() < acceptance)])
        return drafter.propose([DraftRequest("r", [9, 1, 2], 0.0)], 3).confidences[0][0]

    def fresh(rate: float) -> SuffixDrafter:
        cal = SourceCalibration.from_dict(shipped.to_dict())
        return SuffixDrafter(SuffixIndex.build(docs), cal, SuffixConfig(sources=("corpus",), live_bias_rate=rate))

    assert fresh(0.005).propose([DraftRequest("r", [9, 1, 2], 0.0)], 3).confidences[0][0] == pytest.approx(0.9,
                                                                                                           abs=0.02)
    without = run(fresh(0.0), 0.5, 3000)
    drafter = fresh(0.005)
    shifted = run(drafter, 0.5, 3000)
    assert without > 0.85  # the counts alone: still over-confident by ~0.4
    assert abs(shifted - 0.5) < 0.1, shifted
    assert run(drafter, 0.9, 3000) > 0.8  # the traffic changed back
    # the shift is what the native walk reads too: its cells are re-read once the shift moved by 0.02 in
    # log-odds (live_bias_refresh), so they agree with the current survival to within that; the counts it reads
    # are those of the last refresh (every live_refresh_every outcomes), not re-frozen at each re-read
    w = drafter.last["r"].walk
    assert w.conf == pytest.approx(drafter.calibration.conditional("corpus", "greedy", w.freq, w.count, w.match,
                                                                   refreeze=False), abs=0.005)


def test_the_live_shift_learns_each_position_on_its_own():
    """The held-out fit can be off in opposite directions at two positions: shipped, position 1 survives 90 % and
    position 2 (after 1) 50 %; the traffic has 60 % and 90 %. One shift for all positions would trade one
    error for the other; the shift per position bin brings both conditionals to the traffic's."""
    docs = [np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)] * 50
    walk = SuffixIndex.build(docs).walk(np.array([9, 1, 2], dtype=np.int32), 3, WalkParams())
    rng = np.random.default_rng(1)

    def verdict(first: float, second: float) -> int:
        return 0 if rng.random() >= first else 1 if rng.random() >= second else 2

    shipped = SourceCalibration()
    for _ in range(20_000):
        shipped.record("corpus", "greedy", walk.freq, walk.count, walk.match, 2, verdict(0.9, 0.5))
    drafter = SuffixDrafter(SuffixIndex.build(docs), SourceCalibration.from_dict(shipped.to_dict()),
                            SuffixConfig(sources=("corpus",), live_bias_rate=0.005))
    before = drafter.propose([DraftRequest("r", [9, 1, 2], 0.0)], 2).confidences[0]
    assert before == pytest.approx([0.9, 0.5], abs=0.03)
    for _ in range(4000):
        drafter.propose([DraftRequest("r", [9, 1, 2], 0.0)], 2)
        drafter.feedback(["r"], [2], [verdict(0.6, 0.9)])
    after = drafter.propose([DraftRequest("r", [9, 1, 2], 0.0)], 2).confidences[0]
    assert after == pytest.approx([0.6, 0.9], abs=0.08), after
    shift = drafter.calibration.bias[("corpus", "greedy")]
    assert shift[0] < -0.8 and shift[1] > 1.0, shift  # opposite directions, each its own


def test_served_text_joins_its_tenants_index_only_and_old_text_is_evicted():
    from dspark.models.drafters.suffix.served import ServedConfig, ServedText

    served = ServedText(ServedConfig(max_tokens_per_tenant=400, min_rebuild_tokens=8), background=False)
    secret = np.array([7, 8, 9, 10, 11, 12, 13, 14], dtype=np.int32)
    served.add("tenant-a", secret)
    assert served.index_for("tenant-a") is not None and served.index_for("tenant-b") is None
    walk = served.index_for("tenant-a").walk(np.array([7, 8, 9], dtype=np.int32), 3, WalkParams())
    assert walk.tokens == [10, 11, 12]
    for i in range(60):  # 480 more tokens: the oldest text leaves the store and the index
        served.add("tenant-a", np.arange(100 + 8 * i, 108 + 8 * i, dtype=np.int32))
    assert served.index_for("tenant-a").walk(np.array([7, 8, 9], dtype=np.int32), 3, WalkParams()).tokens == []
    assert served.stats()["num_tokens"] <= 400


def test_a_tenants_finished_requests_draft_its_next_ones_and_no_one_elses():
    config = SuffixConfig(sources=("request", "served"))
    config.served.min_rebuild_tokens = 4
    drafter = SuffixDrafter(None, SourceCalibration(), config)
    drafter.served.background = False
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    drafter.propose([DraftRequest("a1", text, 0.0, tenant="a")], 4)
    drafter.release("a1")  # its text joins tenant a's store
    out = drafter.propose([DraftRequest("a2", [1, 5, 6, 7], 0.0, tenant="a"),
                           DraftRequest("b1", [1, 5, 6, 7], 0.0, tenant="b")], 4)
    assert out.tokens[0] == [8, 9, 10, 11] and out.sources[0] == "served"
    assert out.tokens[1] == [] and out.sources[1] == ""  # tenant b never sees tenant a's text


def _served_only_drafter() -> SuffixDrafter:
    config = SuffixConfig(sources=("request", "served"), live_calibration=False, live_bias_rate=0.0)
    config.served.min_rebuild_tokens = 4
    drafter = SuffixDrafter(None, SourceCalibration(), config)
    drafter.served.background = False  # every finished request is indexed before the next one drafts
    return drafter


def test_a_benchmarks_second_round_drafts_as_its_first_did_not_from_its_outputs(tiny_target):
    """bench decode's rounds decode the same prompts again: each round's outputs join a served store of its own,
    so round 2 measures what round 1 did (sharing one, the served source drafted round 1's outputs back)."""
    from dspark.bench.decode import run_interleaved

    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:3]
    cfg = EngineConfig(target=tiny_target.name, drafter="custom", scheduler="fixed", scheduler_kwargs={"k": 4},
                       num_draft_tokens=4, max_num_seqs=1, max_model_len=256)

    def tau(rounds: int) -> float:
        engine = Engine(cfg, target=tiny_target, drafter=_served_only_drafter())
        return run_interleaved({"served": engine}, prompts, 24, rounds)["served"].tau

    once, twice = tau(1), tau(2)
    assert twice == pytest.approx(once)
    # and what the separate stores prevent: the same prompts again in one store draft their earlier outputs
    drafter = _served_only_drafter()
    engine = Engine(cfg, target=tiny_target, drafter=drafter)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.generate([prompts[0]], params)
    engine.stats.clear()
    engine.generate([prompts[0]], params)
    recalled = sum(sum(s.num_accepted) + s.num_requests for s in engine.stats) / len(engine.stats)
    assert recalled > once + 0.5


# ---- `dspark suffix calibrate` ---------------------------------------------------------------------------
def _calibration_corpus(folder: Path, vocab: int) -> None:
    """A shard of self-distilled-like records, half of their prompts in the held-out split at fraction 0.5."""
    from dspark.training.synth import write_shard

    folder.mkdir()
    rng = np.random.default_rng(7)
    phrases = [rng.integers(3, vocab, size=6).tolist() for _ in range(4)]  # text that repeats: walks find it
    records = []
    for i in range(40):
        response = sum((phrases[int(j)] for j in rng.integers(0, 4, size=5)), [])
        records.append({"domain": "chat", "prompt": f"prompt number {i}", "prompt_ids": phrases[i % 4] + [i % 7 + 3],
                        "response_ids": response, "temperature": 0.0, "finish_reason": "length"})
    write_shard(folder / "shard-00000.npz", records, vocab_size=vocab)


def test_calibrate_fits_tables_on_held_out_prompts_and_writes_them(tiny_target_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from dspark.cli import app

    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    _calibration_corpus(tmp_path / "corpus", vocab)
    folder = tmp_path / "suffix"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"corpus_dirs": [str(tmp_path / "corpus")]}))
    args = ["suffix", "calibrate", "--path", str(folder), "--target", str(tiny_target_dir), "--num-prompts", "8",
            "--max-new-tokens", "16", "--temperature", "0", "--heldout-fraction", "0.5", "--batch-size", "4"]
    res = CliRunner().invoke(app, [*args, "--keep-tables"])
    assert res.exit_code == 2 and "no " in res.output and "to keep" in res.output  # nothing to keep yet
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["num_prompts"] == 8 and rep["written"] == str(folder / "calibration.json") and rep["tables"] == "fitted"
    trials = rep["trials"]["greedy"]
    assert sum(trials.values()) > 0
    shipped = SourceCalibration.load(folder / "calibration.json")
    assert {s: t.num_trials for s, t in shipped.tables["greedy"].items()} == trials  # what was fitted is written
    # a scaling fitted for every source with rounds in the scaling quarter; written beside the tables where it
    # lowered that source's held-out ECE
    assert rep["scaling"] and all(len(v["params"]) == 4 for v in rep["scaling"].values())
    assert {tuple(k.split("/")) for k, v in rep["scaling"].items() if v["kept"]} == set(shipped.scaling)
    held = rep["heldout_ece"]["greedy"]
    assert held and all(0 <= v["ece_mean_over_positions"] <= 1 and v["num_rounds"] > 0 for v in held.values())
    assert set(rep["heldout_ece_without_scaling"]["greedy"]) == set(held)
    # --keep-tables: the same tables, only the scaling fitted again
    res = CliRunner().invoke(app, [*args, "--keep-tables"])
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout.strip().splitlines()[-1])
    assert again["tables"] == "kept" and again["trials"]["greedy"] == trials
    assert SourceCalibration.load(folder / "calibration.json").to_dict()["tables"] == shipped.to_dict()["tables"]
