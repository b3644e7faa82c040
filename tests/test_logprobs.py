"""Reported logprobs are the target's own log-softmax (fp32) at the emitted tokens, with and without
speculation, and the HTTP API returns them in OpenAI's formats."""

from __future__ import annotations

import pytest
import torch

from dspark.config.engine import EngineConfig
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams
from tests.test_engine_lossless import tiny_prompts
from tests.tiny import tiny_sps_path


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs or []
    return {i: (p, tokens[i], logprobs[i]) for i, p in zip(ids, prompts)}


@pytest.mark.parametrize("drafter,scheduler", [("none", "fixed"), ("ngram", "fixed"), ("ngram", "greedy")])
def test_logprobs_equal_the_targets_log_softmax_at_the_emitted_tokens(tiny_target, drafter, scheduler) -> None:
    engine = Engine(EngineConfig(target=str(tiny_target.path), drafter=drafter, scheduler=scheduler,
                                 scheduler_kwargs={"k": 4} if scheduler == "fixed" else {}, draft_gate=False,
                                 num_draft_tokens=0 if drafter == "none" else 5, max_num_seqs=4, max_model_len=256,
                                 sps_profile=tiny_sps_path(tiny_target.path)), target=tiny_target)
    prompts = tiny_prompts(tiny_target.model.config.vocab_size)[:6]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=t, seed=i, logprobs=3)
              for i, t in enumerate([0.0, 0.8, 0.0, 1.0, 0.0, 1.2])]
    results = _run(engine, prompts, params)
    assert drafter == "none" or sum(n for s in engine.stats for n in s.num_accepted) > 0  # drafts were accepted
    for prompt, tokens, entries in results.values():
        assert [e.token_id for e in entries] == tokens and len(tokens) == 20
        with torch.no_grad():
            logits = tiny_target.model(torch.tensor([prompt + tokens])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)], dim=-1)  # (n, V)
        got = torch.tensor([e.logprob for e in entries])
        torch.testing.assert_close(got, ref.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-5, rtol=0)
        for e, row in zip(entries, ref):
            values, index = row.topk(3)
            assert [t for t, _ in e.top] == index.tolist()
            torch.testing.assert_close(torch.tensor([lp for _, lp in e.top]), values, atol=1e-5, rtol=0)


def test_requests_without_logprobs_carry_none(tiny_target) -> None:
    engine = Engine(EngineConfig(target=str(tiny_target.path), drafter="none", scheduler="fixed", num_draft_tokens=0,
                                 max_num_seqs=2, max_model_len=128), target=tiny_target)
    (_, tokens, entries), = _run(engine, [[5, 6, 7]], [SamplingParams(max_tokens=5, ignore_eos=True)]).values()
    assert len(tokens) == 5 and entries == []
