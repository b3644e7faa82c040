"""Batching is honest: a request's tokens do not depend on what else shares its steps."""

from __future__ import annotations

import torch

from dspark.config.engine import EngineConfig
from dspark.models.target.loader import TargetModel
from dspark.spec.draft_gate import DraftGate
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams
from tests.test_engine_lossless import tiny_prompts
from tests.tiny import tiny_sps_path


def _engine(target: TargetModel, scheduler: str, max_num_seqs: int) -> Engine:
    cfg = EngineConfig(target=str(target.path), drafter="ngram", scheduler=scheduler,
                       scheduler_kwargs={"k": 6} if scheduler == "fixed" else {},
                       num_draft_tokens=7, max_num_seqs=max_num_seqs, max_model_len=512,
                       sps_profile=tiny_sps_path(target.path),
                       draft_gate=False)  # a tiny model's ~1 ms rounds rightly shut the gate: always draft here
    return Engine(cfg, target=target)


def test_mixed_verification_lengths_in_one_batch_give_each_request_its_solo_tokens(tiny_target):
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:10]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    batched_engine = _engine(tiny_target, "greedy", max_num_seqs=10)
    batched = [r.output_ids for r in batched_engine.generate(prompts, params)]
    # the batch really mixed lengths within single steps
    assert any(len(set(s.lengths)) > 1 for s in batched_engine.stats)
    solo_engine = _engine(tiny_target, "greedy", max_num_seqs=1)
    solo = [solo_engine.generate([p], params)[0].output_ids for p in prompts]
    assert batched == solo


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny_target):
    """With fixed-K the per-request draws do not depend on the batch, so equal seeds give equal text."""
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:6]
    params = [SamplingParams(max_tokens=25, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    batched = [r.output_ids for r in _engine(tiny_target, "fixed", 6).generate(prompts, params)]
    solo = [_engine(tiny_target, "fixed", 1).generate([p], [sp])[0].output_ids for p, sp in zip(prompts, params)]
    assert batched == solo
    other_seed = SamplingParams(max_tokens=25, temperature=0.9, top_p=0.95, seed=999, ignore_eos=True)
    assert _engine(tiny_target, "fixed", 1).generate([prompts[0]], [other_seed])[0].output_ids != solo[0]


def test_one_target_forward_per_step(tiny_target, monkeypatch):
    engine = _engine(tiny_target, "greedy", max_num_seqs=4)
    calls = []
    real = engine.runner.forward

    def counting_forward(chunks, *args, **kwargs):  # the real forward, counted
        calls.append(len(chunks))
        return real(chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", counting_forward)
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:4]
    engine.add_request(prompts[0], SamplingParams(max_tokens=10, ignore_eos=True))
    engine.step()  # prefill of request 0 + its first verify step
    assert calls == [1, 1]
    for p in prompts[1:]:
        engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True))
    calls.clear()
    engine.step()  # the 3 newcomers' prompts ride in request 0's verify forward: ONE forward of 4 chunks
    assert calls == [4]
    calls.clear()
    engine.step()  # then ONE verify forward over all 4
    assert calls == [4]
    assert torch.is_tensor(engine.runner.cache.k[0])


def test_target_only_steps_carry_arriving_prompts_in_the_decode_forward(tiny_target, monkeypatch):
    """Target-only: prompts admitted while others decode ride in the same forward (one weight pass), and
    every request's tokens are still those it gets alone: greedy and seeded sampling."""
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:8]
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             top_p=0.95, seed=7 + i) for i in range(len(prompts))]

    def target_only(max_num_seqs: int) -> Engine:
        return Engine(EngineConfig(target=str(tiny_target.path), drafter="none", scheduler="fixed",
                                   max_num_seqs=max_num_seqs, max_model_len=512, prefix_cache_mb=0),
                      target=tiny_target)

    engine = target_only(3)
    assert engine._can_fuse_admission()
    mixed = []
    real = engine.runner.forward

    def recording_forward(chunks, *args, **kwargs):  # the real forward; notes steps mixing prompts and decodes
        sizes = {len(c.token_ids) > 1 for c in chunks}
        mixed.append(sizes == {True, False})
        return real(chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", recording_forward)
    batched = [r.output_ids for r in engine.generate(prompts, params)]
    assert sum(mixed) >= 3  # refills rode along with running requests' tokens
    solo = [target_only(1).generate([p], [sp])[0].output_ids for p, sp in zip(prompts, params)]
    assert batched == solo


def test_a_round_that_prefills_prompts_drafts_past_a_shut_gate_and_prices_drafts_beside_them(tiny_target,
                                                                                               monkeypatch):
    """Beside a prompt's tokens a draft's verification costs a small share of the forward: such a round drafts
    even where the gate is shut, and the scheduler's step-time table prices its drafts beside the prompts'
    tokens (`SPSTable.with_riders`)."""
    engine = _engine(tiny_target, "greedy", max_num_seqs=2)
    engine.set_draft_gate(DraftGate())
    for _ in range(8):  # batch 1 has lost, round after round: shut
        engine.gate.record(1, 7, 0, 1000.0, 10.0, engine.sps)
    proposals, tables = [], []
    real_propose, real_schedule = engine.drafter.propose, engine.scheduler.schedule

    def counting_propose(reqs, gamma):  # the real drafter, its calls counted
        proposals.append(len(reqs))
        return real_propose(reqs, gamma)

    def recording_schedule(survival, sps):  # the real scheduler, the table it was given noted
        tables.append(sps.meta.get("rider_tokens", 0))
        return real_schedule(survival, sps)

    monkeypatch.setattr(engine.drafter, "propose", counting_propose)
    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    first, second = tiny_prompts(tiny_target.model.config.vocab_size)[:2]
    engine.add_request(first, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # prefill, then a round at batch 1: the gate is shut, nothing drafted
    assert proposals == [] and tables == [0]
    engine.add_request(second, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # the second prompt rides in the first request's round: drafted, priced beside its tokens
    assert proposals == [1] and tables[-1] == len(second)
    assert not engine.gate.should_draft(1)  # the gate itself is still shut at batch 1
