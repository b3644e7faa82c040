"""`SocketChannel`: messages arrive whole and in order, large ones crossing both ways at once do not deadlock
(sends never wait for the peer), a receive says when it is about to wait (`on_block`) and only then, and a
closed or silent peer is an error at once or after the timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dspark.actors.socket_channel import ChannelClosed
from tests.test_pipelined_engine import channel_pair


def test_large_messages_sent_both_ways_at_once_arrive_whole_and_in_order() -> None:
    a, b = channel_pair(timeout_s=30, transport="socket")
    big = [torch.randn(1024, 1024) for _ in range(3)]  # 4 MiB each, far past the kernel's socket buffers
    for i, t in enumerate(big):  # neither side reads before both have sent everything
        a.send({"seq": i, "x": t, "half": t[:, :512].to(torch.bfloat16)})
        b.send({"seq": i, "y": -t})
    assert a.num_pending_sends > 0  # the kernel did not take it all: the rest waits on the writer thread
    got_b = [b.recv() for _ in big]
    got_a = [a.recv() for _ in big]
    a.flush()
    b.flush()
    for i, t in enumerate(big):
        assert got_b[i]["seq"] == i and torch.equal(got_b[i]["x"], t)
        assert torch.equal(got_b[i]["half"], t[:, :512].to(torch.bfloat16))
        assert got_a[i]["seq"] == i and torch.equal(got_a[i]["y"], -t)
    assert a.num_pending_sends == 0 and b.num_pending_sends == 0
    a.close()
    b.close()


def test_a_closed_peer_is_an_error_at_once_and_a_silent_one_after_the_timeout() -> None:
    a, b = channel_pair(timeout_s=1.0, transport="socket")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="Timed out"):
        a.recv()  # b says nothing
    assert 0.9 < time.monotonic() - t0 < 5
    threading.Timer(0.2, b.close).start()
    t0 = time.monotonic()
    with pytest.raises(ChannelClosed):
        a.recv()
    assert time.monotonic() - t0 < 0.9  # the close, not the timeout
    with pytest.raises(ChannelClosed):
        for _ in range(100):  # the first sends may still be taken by the kernel before the reset is seen
            a.send({"x": torch.zeros(1 << 16)})
            time.sleep(0.01)
    a.close()


def test_on_block_runs_only_when_the_message_is_not_in_yet() -> None:
    a, b = channel_pair(timeout_s=30, transport="socket")
    calls: list[float] = []
    b.send({"seq": 0})
    deadline = time.monotonic() + 10
    while not a._readable(0.01) and time.monotonic() < deadline:  # the message is in a's kernel buffer
        pass
    assert a.recv(on_block=lambda: calls.append(time.monotonic())) == {"seq": 0}
    assert calls == []  # in already: no wait, so nothing to free before it
    threading.Timer(0.3, b.send, args=({"seq": 1},)).start()
    t0 = time.monotonic()
    assert a.recv(on_block=lambda: calls.append(time.monotonic())) == {"seq": 1}
    assert len(calls) == 1 and calls[0] - t0 < 0.2  # once, before the wait, not after it
    a.close()
    b.close()
