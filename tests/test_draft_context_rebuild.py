"""A replaced draft worker starts with no context: the verify side recomputes the target features of every
running request's cached tokens (a scratch KV pool, the serving cache untouched) and ships them, so a
feature drafter (DSpark) drafts again for the requests that were running, on their full context. Without
it the new DSpark drafter cannot draft them at all (it needs the features of every position before the
anchor); the draft service then skips those requests instead of failing the link."""

from __future__ import annotations

import threading

import torch

from dspark.draft_service.client import RemoteDrafter
from dspark.draft_service.service import DraftService, serve_channel
from dspark.models.drafters.dspark.drafter import DSparkDrafter
from dspark.verify_service.engine import Engine
from dspark.verify_service.pipelined_engine import PipelinedEngine
from dspark.verify_service.request import SamplingParams
from tests.test_pipelined_engine import NUM_NEW, RecordingNgram, channel_pair, config, prompts, target_only  # noqa: F401
from tests.tiny_drafters import make_dspark

PARAMS = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)


def _serve(drafter: DSparkDrafter) -> tuple[object, DraftService, threading.Thread]:
    verify_end, draft_end = channel_pair()
    service = DraftService(drafter)
    thread = threading.Thread(target=serve_channel, args=(draft_end, service), daemon=True)
    thread.start()
    return verify_end, service, thread


def _step(engine: Engine, out: dict[str, list[int]], num_steps: int | None = None) -> None:
    """Step `num_steps` times (None: until done), collecting each request's tokens into `out`."""
    n = 0
    while engine.has_unfinished() and (num_steps is None or n < num_steps):
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        n += 1


def test_rebuilt_features_equal_the_ones_the_drafter_was_fed(tiny_target, prompts, target_only) -> None:  # noqa: F811
    first = RecordingNgram((1, 2))
    engine = Engine(config(tiny_target, "fixed", draft_gate=False), target=tiny_target, drafter=first)
    ids = [engine.add_request(p, PARAMS) for p in prompts[:5]]
    out: dict[str, list[int]] = {i: [] for i in ids}
    _step(engine, out, 4)
    cached = {r.request_id: r.num_cached for r in engine.running}
    budget = RecordingNgram((1, 2))  # a bounded rebuild: whole requests, within the budget
    engine.drafter = budget
    n = engine.rebuild_draft_contexts(max_positions=max(cached.values()))
    assert 0 < n <= max(cached.values()) and all(torch.cat(v).shape[0] == cached[k] for k, v in budget.seen.items())
    assert len(budget.seen) < len(cached)
    engine.drafter = second = RecordingNgram((1, 2))  # what a new draft worker has: nothing
    assert engine.rebuild_draft_contexts(max_seqs=2, batch_tokens=64) == sum(cached.values())
    for rid, n in cached.items():
        before, after = torch.cat(first.seen[rid])[:n], torch.cat(second.seen[rid])
        assert after.shape[0] == n
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    _step(engine, out)
    assert [out[i] for i in ids] == target_only[:5]  # the serving cache was left as it was
    assert engine.runner.cache.num_active == 0


def test_a_new_draft_worker_drafts_the_running_requests_after_a_re_pair(tiny_target, prompts, target_only) -> None:  # noqa: F811
    model = make_dspark(tiny_target)
    remote_end, _, thread = _serve(DSparkDrafter(model, tiny_target))
    layers = tuple(model.config.target_layers)
    remote = RemoteDrafter(remote_end, layers)
    engine = PipelinedEngine(config(tiny_target, "fixed", draft_gate=False), target=tiny_target, drafter=remote)
    ids = [engine.add_request(p, PARAMS) for p in prompts[:6]]
    out: dict[str, list[int]] = {i: [] for i in ids}
    _step(engine, out, 4)
    running = {r.request_id for r in engine.running if not r.is_finished}
    assert running
    remote_end.send({"kind": "close"})
    thread.join(timeout=30)

    new_end, service, thread = _serve(DSparkDrafter(model, tiny_target))  # the replacement, empty
    remote.reconnect(new_end)
    assert engine.rebuild_draft_contexts() > 0
    drafted_before = {r.request_id: r.num_drafted for r in engine.running}
    while engine.has_unfinished():
        _step(engine, out, 1)
        running -= {r.request_id for r in engine.running if r.num_drafted > drafted_before.get(r.request_id, 0)}
    new_end.send({"kind": "close"})
    thread.join(timeout=30)
    assert [out[i] for i in ids] == target_only[:6]  # lossless through the swap
    assert not service._unusable  # every request was draftable on the new worker
    assert not running, f"requests running at the swap never drafted again: {running}"


def test_a_request_the_drafter_cannot_draft_gets_an_empty_draft_and_the_rest_go_on(tiny_target) -> None:
    model = make_dspark(tiny_target)
    service = DraftService(DSparkDrafter(model, tiny_target))
    taps = len(model.config.target_layers) * tiny_target.model.config.hidden_size
    good = {"id": "good", "new_tokens": [5, 6, 7, 8], "temperature": 0.0, "num_features": 3}
    bad = {"id": "bad", "new_tokens": [5, 6, 7, 8], "temperature": 0.0, "num_features": 0}  # no context
    message = {"kind": "draft", "seq": 0, "max_num_tokens": 3, "requests": [bad, good],
               "features": torch.randn(3, taps), "released": []}
    reply = service.handle(message)
    assert reply["tokens"][0] == [] and len(reply["tokens"][1]) == 3
    assert service._unusable == {"bad"}
    again = service.handle({**message, "seq": 1, "requests": [{**bad, "new_tokens": []},
                                                               {**good, "new_tokens": [9], "num_features": 1}],
                            "features": torch.randn(1, taps)})
    assert again["tokens"][0] == [] and len(again["tokens"][1]) == 3
