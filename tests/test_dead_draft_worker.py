"""A draft worker killed with SIGKILL mid-generation costs speed, never a request: its verify side notices
the broken channel (socket or gloo) at once and finishes every request target-only, token for token as without it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from dspark.actors.transport import free_port, open_channel
from dspark.draft_service.client import RemoteDrafter
from dspark.verify_service.pipelined_engine import PipelinedEngine
from dspark.verify_service.request import SamplingParams
from tests.test_pipelined_engine import NUM_NEW, config, prompts, target_only  # noqa: F401 - fixtures


def _serve_ngram(transport: str, port: int) -> None:  # the draft worker: its own process, as in the cluster
    from dspark.draft_service.service import DraftService, serve_channel
    from dspark.models.drafters.ngram import NgramDrafter

    torch.set_num_threads(1)
    serve_channel(open_channel(transport, "127.0.0.1", port, 1, timeout_s=30), DraftService(NgramDrafter()))


@pytest.mark.parametrize("transport", ["socket", "gloo"])
def test_a_killed_draft_worker_fails_no_request_and_output_stays_lossless(
        tiny_target, prompts, target_only, transport) -> None:  # noqa: F811 - the imported fixtures, by name
    port = free_port()
    proc = mp.get_context("spawn").Process(target=_serve_ngram, args=(transport, port), daemon=True)
    proc.start()
    try:
        remote = RemoteDrafter(open_channel(transport, "127.0.0.1", port, 0, timeout_s=30), ())
        engine = PipelinedEngine(config(tiny_target, scheduler="fixed", draft_gate=False), target=tiny_target,
                                 drafter=remote)
        params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        num_steps = 0
        while engine.has_unfinished():
            if num_steps == 6:  # mid-generation, with rounds in flight
                assert sum(s.num_tokens - s.num_requests for s in engine.stats) > 0  # it was drafting
                os.kill(proc.pid, signal.SIGKILL)
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            num_steps += 1
        assert remote.is_broken  # and said why (the channel's error), in the worker's stats and log
        assert [tokens[i] for i in ids] == target_only  # every request finished, exactly
        drafted_after = [s for s in engine.stats[8:] if s.num_tokens > s.num_requests]
        assert not drafted_after  # target-only once the peer was gone
    finally:
        proc.kill()
        proc.join(timeout=10)
