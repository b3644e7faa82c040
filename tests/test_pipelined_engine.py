"""Pipelined engine (two micro-batches in ping-pong) and the gloo draft transport, without Ray."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dspark.actors.transport import PairChannel, free_port, open_channel
from dspark.actors.wire import decode, encode
from dspark.config.engine import EngineConfig
from dspark.draft_service.client import RemoteDrafter
from dspark.draft_service.service import DraftService, serve_channel
from dspark.kernels import omp_teams
from dspark.models.drafters.base import DraftOutput, DraftRequest
from dspark.models.drafters.ngram import NgramDrafter
from dspark.models.target.loader import TargetModel
from dspark.spec.sps import SPSTable
from dspark.verify_service.engine import Engine
from dspark.verify_service.pipelined_engine import PUSH_MIN_ROWS, PipelinedEngine
from dspark.verify_service.request import SamplingParams
from tests.test_engine_lossless import tiny_prompts
from tests.tiny import tiny_sps_path

NUM_NEW = 24


class RecordingNgram(NgramDrafter):
    """An n-gram drafter that also keeps every feature row it is shown (as a feature drafter would)."""

    def __init__(self, hidden_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.hidden_layers = hidden_layers
        self.seen: dict[str, list[torch.Tensor]] = {}

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        self.seen.setdefault(request_id, []).append(features.clone())


class SlowNgram(NgramDrafter):
    """An n-gram drafter whose every draft round costs 5 ms more: a drafter worth gating on a tiny model."""

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        time.sleep(0.005)
        return super().propose(requests, max_num_tokens)


def config(target: TargetModel, scheduler: str = "greedy", drafter: str = "ngram",
           draft_gate: bool = True) -> EngineConfig:
    # the tests' SPS profile, not one measured on this (possibly loaded) machine: the lengths a load-aware
    # scheduler picks must not depend on the noise of a start-up measurement
    return EngineConfig(target=str(target.path), drafter=drafter, scheduler=scheduler, num_draft_tokens=5,
                        max_num_seqs=6, max_model_len=256, draft_gate=draft_gate,
                        sps_profile=tiny_sps_path(target.path))


TRANSPORTS = ["socket", "gloo"]  # the point-to-point channels a pair may use


def channel_pair(timeout_s: float = 120.0, transport: str = "gloo") -> tuple[PairChannel, PairChannel]:
    port, made = free_port(), {}
    t = threading.Thread(target=lambda: made.setdefault(1, open_channel(transport, "127.0.0.1", port, 1, timeout_s)))
    t.start()
    made[0] = open_channel(transport, "127.0.0.1", port, 0, timeout_s)
    t.join()
    return made[0], made[1]


@pytest.fixture(scope="module")
def prompts(tiny_target) -> list[list[int]]:
    return tiny_prompts(tiny_target.model.config.vocab_size)[:14]


@pytest.fixture(scope="module")
def target_only(tiny_target, prompts) -> list[list[int]]:
    engine = Engine(config(tiny_target, "fixed", "none"), target=tiny_target)
    return [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))]


@pytest.mark.parametrize("num_micro_batches", [1, 2, 3])
def test_pipelined_engine_greedy_equals_target_only(tiny_target, prompts, target_only, num_micro_batches):
    engine = PipelinedEngine(config(tiny_target, draft_gate=False), target=tiny_target,
                             num_micro_batches=num_micro_batches)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    assert [r.output_ids for r in reqs] == target_only
    assert sum(r.num_accepted for r in reqs) > 0
    if num_micro_batches > 1:  # steps really alternate between halves of the batch
        assert max(s.num_requests for s in engine.stats) <= -(-6 // num_micro_batches) + 1


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_arriving_prompts_ride_in_a_pipelined_round_and_greedy_output_stays_target_only(
        tiny_target, prompts, monkeypatch, num_micro_batches):
    """The verify workers' engine admits as the plain one does: prompts that arrive while others speculate are
    computed in the round's forward (one pass over the weights), not a prefill forward of their own. Requests
    of different lengths, greedy and sampled, end and are refilled at different steps; the greedy ones get
    target-only's tokens. (A sampled request's tokens depend on when its drafts come, which batching moves; its
    distribution is the T = 1 tests'.)"""
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             top_p=0.95, seed=11 + i) for i in range(8)]
    engine = PipelinedEngine(config(tiny_target, draft_gate=False), target=tiny_target,
                             num_micro_batches=num_micro_batches)
    engine.config.max_num_seqs = 3
    assert engine._can_fuse_admission()
    forwards = []
    real = engine.runner.forward

    def recording_forward(chunks, *args, **kwargs):  # the real forward; notes prompts beside running tokens
        forwards.append({c.start_pos == 0 for c in chunks})
        return real(chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", recording_forward)
    batched = engine.generate(prompts[:8], params)
    assert sum(kinds == {True, False} for kinds in forwards) >= 3  # refills rode with running requests
    assert sum(r.num_accepted for r in batched) > 0
    assert [len(r.output_ids) for r in batched] == [p.max_tokens for p in params]
    plain = Engine(config(tiny_target, "fixed", "none"), target=tiny_target)
    greedy = [i for i, sp in enumerate(params) if sp.temperature == 0]
    assert [batched[i].output_ids for i in greedy] == [plain.generate([prompts[i]], [params[i]])[0].output_ids
                                                       for i in greedy]


def test_encode_roundtrip_keeps_structure_and_tensors():
    view = torch.arange(12.0).reshape(3, 4)[:, 1]  # not contiguous: sent as its values
    msg = {"a": [1, (2, torch.arange(3))], "b": {"c": torch.ones(2, 2, dtype=torch.bfloat16)}, "d": None,
           "v": view, "s": {"x", "y"}}
    data, tensors = encode(msg)
    assert len(tensors) == 3 and all(t.is_contiguous() for t in tensors)
    out = decode(data, [t.clone() for t in tensors])
    assert out["a"][0] == 1 and isinstance(out["a"][1], tuple) and out["d"] is None and out["s"] == {"x", "y"}
    assert torch.equal(out["a"][1][1], torch.arange(3)) and out["b"]["c"].dtype == torch.bfloat16
    assert torch.equal(out["v"], torch.tensor([1.0, 5.0, 9.0]))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_channel_moves_messages_both_ways_with_one_in_flight_each_way(transport):
    a, b = channel_pair(transport=transport)
    x = torch.randn(16, 576)
    a.send({"kind": "draft", "x": x, "empty": torch.empty(0, 4)})
    a.send({"kind": "draft", "x": 2 * x})  # a second message before the first was answered
    got1 = b.recv()
    b.send({"reply": got1["x"].sum()})
    got2 = b.recv()
    b.send({"reply": got2["x"].sum()})
    assert torch.equal(got1["x"], x) and got1["empty"].shape == (0, 4)
    assert torch.allclose(a.recv()["reply"], x.sum()) and torch.allclose(a.recv()["reply"], 2 * x.sum())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_remote_drafter_over_a_channel_is_lossless_and_delivers_the_exact_features(tiny_target, prompts, target_only,
                                                                                   transport):
    # no draft gate: it reacts to timings, so the two runs could batch differently, and features computed in
    # different batch shapes differ in the last bits
    layers = (1, 2)
    local = RecordingNgram(layers)
    engine = PipelinedEngine(config(tiny_target, draft_gate=False), target=tiny_target, drafter=local)
    local_out = [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))]

    verify_end, draft_end = channel_pair(transport=transport)
    far = RecordingNgram(layers)
    server = threading.Thread(target=serve_channel, args=(draft_end, DraftService(far)), daemon=True)
    server.start()
    # as a CPU verify worker with one micro-batch runs it: the OpenMP team freed before each wait for a reply
    released = []

    def release() -> None:
        released.append(1)
        omp_teams.release()

    remote = RemoteDrafter(verify_end, layers, on_block=release)
    engine = PipelinedEngine(config(tiny_target, draft_gate=False), target=tiny_target, drafter=remote)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    verify_end.send({"kind": "close"})
    server.join(timeout=30)

    assert [r.output_ids for r in reqs] == local_out == target_only
    assert sum(r.num_accepted for r in reqs) > 0
    # request ids are req-N in both runs. The far side gets features with the next draft round, so it
    # sees exactly the local rows except those of a request's final step (no round follows it).
    for rid, rows in local.seen.items():
        here, there = torch.cat(rows), torch.cat(far.seen[rid])
        assert torch.equal(there, here[:there.shape[0]]), rid
        assert there.shape[0] >= here.shape[0] - rows[-1].shape[0], rid
    assert remote.spans and all(s.transport_ms >= 0 for s in remote.spans)
    assert len(released) == remote.num_blocked_rounds  # the team is freed once per wait, and only then
    if transport == "gloo":  # gloo cannot tell whether a reply is in: every wait frees the team first
        assert remote.num_blocked_rounds == len(remote.spans)
    else:  # a socket can: only the waits for a reply not yet in do (how many depends on timing: the channel's
        assert remote.num_blocked_rounds <= len(remote.spans)  # own test checks the rule both ways)


class SlowRecordingNgram(RecordingNgram):
    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        time.sleep(0.005)
        return super().propose(requests, max_num_tokens)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_push_ships_context_one_way_and_the_next_round_carries_only_what_is_new(transport):
    verify_end, draft_end = channel_pair(transport=transport)
    far = RecordingNgram((1,))
    server = threading.Thread(target=serve_channel, args=(draft_end, DraftService(far)), daemon=True)
    server.start()
    remote = RemoteDrafter(verify_end, (1,))
    assert remote.can_push
    a, b = torch.randn(20, 4), torch.randn(2, 4)
    req = DraftRequest("r", [5, 6, 7, 5, 6], 0.0)
    remote.observe("r", a)
    assert remote.num_buffered_rows([req]) == 20
    remote.push([req])  # no reply comes back for it...
    remote.observe("r", b)
    assert remote.num_buffered_rows([req]) == 2
    remote.submit([DraftRequest("r", [5, 6, 7, 5, 6, 7], 0.0)], 3)
    out = remote.collect()  # ...so the next reply read is this round's
    verify_end.send({"kind": "close"})
    server.join(timeout=30)
    assert out.tokens == [[5, 6, 7]]  # the far side's history has the pushed and the new token
    assert [t.shape[0] for t in far.seen["r"]] == [20, 2]
    assert torch.equal(far.seen["r"][0], a) and torch.equal(far.seen["r"][1], b)
    assert len(remote.push_ms) == 1 and len(remote.spans) == 1


def _serve_recording(channel: PairChannel, errors: list[BaseException]) -> None:
    try:
        serve_channel(channel, DraftService(RecordingNgram((1,))))
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        errors.append(exc)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("keepalive", [True, False])
def test_keepalives_hold_an_idle_pair_open_past_its_receive_timeout(keepalive, transport):
    verify_end, draft_end = channel_pair(timeout_s=2.0, transport=transport)
    errors: list[BaseException] = []
    server = threading.Thread(target=_serve_recording, args=(draft_end, errors), daemon=True)
    server.start()
    remote = RemoteDrafter(verify_end, (1,))
    sent = 0
    for _ in range(14):  # 3.5 s of silence from the engine: longer than the draft side's 2 s receive
        time.sleep(0.25)
        if keepalive:
            sent += remote.keepalive(max_silence_s=0.5)
    if keepalive:
        assert sent >= 4 and not errors
        remote.submit([DraftRequest("r", [3, 4, 3], 0.0)], 2)
        assert remote.collect().tokens == [[4, 3]]  # the pair still works
        verify_end.send({"kind": "close"})
        server.join(timeout=30)
        assert not errors
    else:  # the failure the keepalive prevents: the draft side gave up on the pair
        server.join(timeout=30)
        assert errors and "Timed out" in str(errors[0])


def test_an_idle_async_engine_keeps_its_draft_pair_alive(tiny_target, prompts, target_only):
    import asyncio

    from dspark.verify_service.async_engine import AsyncEngine

    verify_end, draft_end = channel_pair(timeout_s=2.0)
    errors: list[BaseException] = []
    server = threading.Thread(target=_serve_recording, args=(draft_end, errors), daemon=True)
    server.start()
    remote = RemoteDrafter(verify_end, (1,), keepalive_s=0.5)
    engine = AsyncEngine(PipelinedEngine(config(tiny_target, draft_gate=False), target=tiny_target, drafter=remote))
    try:
        time.sleep(3.5)  # idle longer than the draft side's receive timeout

        async def one() -> list[int]:
            last = None
            async for out in engine.generate(prompts[0], SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)):
                last = out
            return last.output_ids

        assert asyncio.run(one()) == target_only[0]
        assert not errors and remote.push_ms and remote.spans
    finally:
        engine.shutdown()
        verify_end.send({"kind": "close"})
        server.join(timeout=30)


def test_no_push_over_a_channel_that_can_reorder():
    from dspark.actors.transport import RayChannel

    remote = RemoteDrafter(RayChannel(actor=None), (1,))
    assert not remote.can_push
    with pytest.raises(RuntimeError, match="order"):
        remote.push([DraftRequest("r", [1], 0.0)])


def test_while_the_gate_skips_a_remote_drafter_still_gets_the_context_and_output_is_lossless(
        tiny_target, prompts, target_only):
    layers = (1, 2)
    verify_end, draft_end = channel_pair()
    far = SlowRecordingNgram(layers)  # 5 ms a round: the gate shuts on the tiny model
    server = threading.Thread(target=serve_channel, args=(draft_end, DraftService(far)), daemon=True)
    server.start()
    remote = RemoteDrafter(verify_end, layers)
    engine = PipelinedEngine(config(tiny_target), target=tiny_target, drafter=remote)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    verify_end.send({"kind": "close"})
    server.join(timeout=30)
    assert [r.output_ids for r in reqs] == target_only
    assert engine.gate is not None and engine.gate.num_skipped > engine.gate.num_drafted
    assert remote.push_ms  # context went over while no round did
    # every request's rows reached the far side except a tail that never filled a push (at most the
    # threshold plus one step of its micro-batch: ≤ max_num_seqs requests × (γ + 1) rows)
    tail = PUSH_MIN_ROWS + engine.config.max_num_seqs * (engine.config.num_draft_tokens + 1)
    for i, r in enumerate(reqs):
        got = sum(t.shape[0] for t in far.seen.get(r.request_id, []))
        assert got >= len(prompts[i]) + NUM_NEW - 1 - tail, (r.request_id, got)


@pytest.mark.parametrize("engine_cls", [Engine, PipelinedEngine])
def test_draft_gate_stops_drafting_where_it_loses_and_stays_lossless(tiny_target, prompts, target_only, tmp_path,
                                                                     engine_cls):
    # a profile where a verified draft token costs 100 target steps: no draft can ever pay for itself
    steep = tmp_path / "steep.json"
    SPSTable([1, 2], [10.0, 1000.0]).save(steep)
    # and a drafter whose rounds cost 5 ms: on the tiny model's ~1 ms rounds, a loss no clock noise hides
    cfg = config(tiny_target)
    cfg.sps_profile = str(steep)
    engine = engine_cls(cfg, target=tiny_target, drafter=SlowNgram())
    reqs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    assert [r.output_ids for r in reqs] == target_only
    gate = engine.gate
    assert gate is not None and gate.num_skipped > gate.num_drafted > 0
    assert all(g < 1.0 for g in gate.gains().values())
    assert sum(s.draft_ms == 0.0 or not any(s.lengths) for s in engine.stats) == len(engine.stats)
    if engine_cls is PipelinedEngine:  # with nothing to overlap, steps serve the whole batch, not one half
        assert max(s.num_requests for s in engine.stats) == cfg.max_num_seqs

    cfg.draft_gate = False  # the same run without the gate drafts every step
    engine = engine_cls(cfg, target=tiny_target)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    assert [r.output_ids for r in reqs] == target_only
    assert engine.gate is None


def test_fixed_k_never_gates(tiny_target):
    assert Engine(config(tiny_target, "fixed"), target=tiny_target).gate is None


@pytest.mark.parametrize("engine_cls", [Engine, PipelinedEngine])
def test_prefill_of_admitted_requests_is_not_counted_as_step_overhead(tiny_target, prompts, engine_cls):
    # a new request every step: each gap between rounds is mostly its prefill, which drafting does not
    # change, so the gate's per-step overhead O must stay near the serving loop's own cost
    engine = engine_cls(config(tiny_target), target=tiny_target)
    long_prompt = (prompts[0] * 20)[:200]
    for _ in range(engine.config.max_num_seqs):
        engine.add_request(long_prompt, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
        engine.step()
    rounds_ms = [s.draft_ms + s.schedule_ms + s.verify_ms for s in engine.stats]
    assert engine.gate is not None
    assert engine.gate.overhead_ms < 0.25 * sorted(rounds_ms)[len(rounds_ms) // 2]
