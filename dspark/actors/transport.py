"""Message transport between a paired verify worker and draft worker.

A message is a dict of plain Python values and torch tensors (at any nesting depth), encoded by `wire`.
Three channels; `open_channel` opens a pair's point-to-point end of the first two:

- `SocketChannel` (`socket_channel.py`): one TCP connection; a message is one `sendmsg`, no notices go
  back and forth before its bytes move.

- `GlooChannel`: `torch.distributed` point-to-point over a process group built for THIS pair only
  (`ProcessGroupGloo` on its own TCPStore; NCCL on GPUs), so pairs can be rebuilt when pools change
  without touching a global default group. A message goes as a fixed-size first part (a header and,
  when it fits, the skeleton: the pickled message and its tensors' shapes), then the skeleton if it did
  not fit, then each tensor's raw bytes.
  Each part is its own gloo message, and gloo sends a part only once the peer has posted its receive (the
  receiver tells the sender it is ready), so every part past the first, whose receive is posted once the
  one before has arrived, costs a round of notices between the two processes. On 2 shared cores right after
  a verify step that is where a draft round's time went: an echo of 3 parts took 0.8-7.7 ms at the median
  and ~8 ms at p90, of 1 part 0.55-0.58 / 0.6-0.7 ms (session 44). So the skeleton rides in the first part
  (16 KiB: a round's skeleton at batch 32 is a few KiB), the tensors' receives are posted together, and a
  side that expects a reply posts its first part's receive when it sends (`expect`). Sends are
  asynchronous and never waited for in line (their buffers are kept until done): gloo completes a send
  only when the peer posts the matching receive, and the ping-pong keeps a message in flight each way, so
  waiting at once would deadlock.
  Gloo's send work never reports completion until it is waited for (`is_completed()` stays False), so
  each header also carries how many messages its sender has received: the sends of those messages are
  done at the peer, and waiting for them returns at once, which frees their buffers. Without it every
  tensor ever sent (a request's target features) stayed referenced for the life of the channel.
- `RayChannel` (fallback, and the baseline it is measured against): the same messages as actor-call
  arguments and return values through Ray's object store.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import socket
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from dspark.actors.socket_channel import SocketChannel
from dspark.actors.wire import decode, empty_tensors, encode, tensor_metas

_HEADER_TAG, _SKELETON_TAG, _TENSOR_TAG = 1, 2, 3
_HEADER_LEN = 3  # (skeleton bytes, number of tensors, messages the sender has received)
_FIRST_BYTES = 16384  # a message's first part: the header, then the skeleton where it fits
_HEADER_BYTES = _HEADER_LEN * 8


class Channel(Protocol):
    def send(self, message: Any) -> None: ...

    def recv(self, on_block: Callable[[], None] | None = None) -> Any:
        """The next message; `on_block` runs first when it may not be here yet (the caller is about to wait)."""
        ...

    def close(self) -> None: ...

    def expect(self) -> None:
        """A message is coming (the reply to one just sent): get ready to take it at once."""
        ...


def free_port(host: str = "") -> int:
    """A port nobody listens on, drawn below the kernel's ephemeral range (`ip_local_port_range`, where the
    OS hands out ports for outgoing connections and `bind(0)`) and above Ray's worker ports (10002-19999):
    a port from `bind(0)` can be taken by any new connection between this check and the server's bind."""
    low, high = 20000, 32767
    with contextlib.suppress(OSError, ValueError):
        low_eph = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        high = min(high, low_eph - 1)
    for _ in range(200 if high > low else 0):
        port = random.randint(low, high)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: loopback
        return "127.0.0.1"


class GlooChannel:
    """One end of a two-rank process group (rank 0 hosts the store). Not thread-safe: one sender, one receiver."""

    ordered = True  # messages arrive in send order, so one-way messages (no reply) are safe

    def __init__(self, host: str, port: int, rank: int, timeout_s: float = 120.0) -> None:
        if rank not in (0, 1):
            raise ValueError("a channel has ranks 0 and 1")
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, 2, rank == 0, timeout=timeout)
        self.group = dist.ProcessGroupGloo(self.store, rank, 2, timeout)  # blocks until the peer joins
        self.rank, self.peer = rank, 1 - rank
        # (message index, work, buffers kept alive) of sends the peer has not acknowledged yet
        self._pending_sends: list[tuple[int, Any, list[torch.Tensor]]] = []
        self.num_bytes_sent = 0
        self.num_messages_sent = 0
        self.num_messages_received = 0
        self._first: tuple[torch.Tensor, Any] | None = None  # the next message's first part, receive posted

    def send(self, message: Any) -> None:
        data, tensors = encode(message)
        pickled = np.frombuffer(pickle.dumps((tensor_metas(tensors), data), protocol=pickle.HIGHEST_PROTOCOL),
                                dtype=np.uint8)
        first = np.zeros(_FIRST_BYTES, dtype=np.uint8)
        first[:_HEADER_BYTES] = np.array([len(pickled), len(tensors), self.num_messages_received],
                                         dtype=np.int64).view(np.uint8)
        parts = [(torch.from_numpy(first), _HEADER_TAG)]
        if _HEADER_BYTES + len(pickled) <= _FIRST_BYTES:
            first[_HEADER_BYTES:_HEADER_BYTES + len(pickled)] = pickled
        else:
            parts.append((torch.from_numpy(pickled.copy()), _SKELETON_TAG))
        parts += [(t, _TENSOR_TAG) for t in tensors if t.numel()]
        for tensor, tag in parts:
            self._pending_sends.append((self.num_messages_sent, self.group.send([tensor], self.peer, tag), [tensor]))
            self.num_bytes_sent += tensor.numel() * tensor.element_size()
        self.num_messages_sent += 1

    def expect(self) -> None:
        """Post the next message's first receive now (once), so that its sender need not wait for the notice."""
        if self._first is None:
            first = torch.empty(_FIRST_BYTES, dtype=torch.uint8)
            self._first = (first, self.group.recv([first], self.peer, _HEADER_TAG))

    def recv(self, on_block: Callable[[], None] | None = None) -> Any:
        self.expect()
        first, work = self._first  # type: ignore[misc]
        self._first = None
        if on_block is not None:
            on_block()  # gloo cannot say whether the message is in before the wait: a receive meets its send
        work.wait()
        raw = first.numpy()
        num_bytes, _, peer_received = raw[:_HEADER_BYTES].view(np.int64).tolist()
        if _HEADER_BYTES + num_bytes <= _FIRST_BYTES:
            pickled = raw[_HEADER_BYTES:_HEADER_BYTES + num_bytes].tobytes()
        else:
            blob = torch.empty(num_bytes, dtype=torch.uint8)
            self.group.recv([blob], self.peer, _SKELETON_TAG).wait()
            pickled = blob.numpy().tobytes()
        metas, data = pickle.loads(pickled)
        tensors = empty_tensors(metas)
        works = [self.group.recv([t], self.peer, _TENSOR_TAG) for t in tensors if t.numel()]  # posted together
        for w in works:
            w.wait()
        self.num_messages_received += 1
        self._reap_sends(peer_received)
        return decode(data, tensors)

    @property
    def num_pending_sends(self) -> int:
        return len(self._pending_sends)

    def _reap_sends(self, peer_received: int) -> None:
        """Drop the sends of the messages the peer says it has received (waiting for them returns at
        once); newer ones may still wait for the peer's receive."""
        keep = []
        for index, work, buffers in self._pending_sends:
            if index < peer_received:
                work.wait()
            else:
                keep.append((index, work, buffers))
        self._pending_sends = keep

    def flush(self) -> None:
        """Wait until every message sent so far was received by the peer."""
        for _, work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []

    def close(self) -> None:
        self._pending_sends = []
        self._first = None
        self.group = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


class RayChannel:
    """The fallback: requests ride actor calls; replies are ObjectRefs collected in order."""

    ordered = False  # a threaded actor may run two calls out of order: every message gets a reply

    def __init__(self, actor: Any, method: str = "handle") -> None:
        self.actor, self.method = actor, method
        self._replies: deque = deque()

    def send(self, message: Any) -> None:
        self._replies.append(getattr(self.actor, self.method).remote(message))

    def recv(self, on_block: Callable[[], None] | None = None) -> Any:
        import ray

        reply = self._replies.popleft()
        if on_block is not None and not ray.wait([reply], timeout=0)[0]:
            on_block()
        return ray.get(reply)

    def expect(self) -> None:
        pass  # a reply is an ObjectRef, collected when it is read

    def close(self) -> None:
        self._replies.clear()


PairChannel = GlooChannel | SocketChannel  # a pair's point-to-point link


def open_channel(transport: str, host: str, port: int, rank: int,
                 timeout_s: float = 120.0) -> PairChannel:
    """One end of a pair's point-to-point link (`transport` "socket" or "gloo"): rank 0 (the verify side) hosts
    it at (host, port), rank 1 joins; blocks until both ends are there."""
    if transport == "socket":
        return SocketChannel(host, port, rank, timeout_s)
    if transport == "gloo":
        return GlooChannel(host, port, rank, timeout_s)
    raise ValueError(f"no point-to-point channel for transport {transport!r}")
