"""Measure the draft<->verify transports between two Ray actors: round trips of feature-sized tensors.

`TransportProbe` actors pair up like a verify and a draft worker (one hosts the channel, the other echoes);
`measure_transports` sends messages shaped like a step's traffic (a (n, F) feature block one way and back)
and reports the round-trip time per size for each point-to-point channel (socket, gloo) and for Ray object
refs, and whether every tensor came back bit-identical.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import ray
import torch

from dspark.actors.transport import Channel, PairChannel, RayChannel, free_port, node_ip, open_channel


class TransportProbe:
    def __init__(self) -> None:
        self.channel: PairChannel | None = None
        self._address: tuple[str, int] | None = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        self._address = (node_ip(), free_port())
        return self._address

    def open(self, transport: str, host: str, port: int, rank: int) -> None:
        self.channel = open_channel(transport, host, port, rank)

    def echo_forever(self) -> int:
        """Answer every message with itself until `close`; returns how many it echoed."""
        n = 0
        while True:
            message = self.channel.recv()  # type: ignore[union-attr]
            if message.get("kind") == "close":
                return n
            self.channel.send(message)  # type: ignore[union-attr]
            n += 1

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        return message

    def measure(self, transport: str, peer: Any, rows: list[int], num_features: int, reps: int) -> dict[str, Any]:
        channel: Channel = RayChannel(peer) if transport == "ray" else self.channel  # type: ignore[assignment]
        gen = torch.Generator().manual_seed(0)
        out: dict[str, Any] = {}
        for n in rows:
            x = torch.randn(n, num_features, generator=gen)
            times, is_exact = [], True
            for i in range(reps + 2):  # 2 warm-up round trips
                t0 = time.perf_counter()
                channel.send({"kind": "draft", "seq": i, "features": x, "tokens": [[1, 2, 3]] * 8})
                back = channel.recv()
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
                is_exact &= torch.equal(back["features"], x) and back["seq"] == i
            out[str(n)] = {"rtt_ms_median": statistics.median(times),
                           "rtt_ms_p90": sorted(times)[int(0.9 * len(times))],
                           "mb": x.numel() * 4 / 2**20, "is_exact": is_exact}
        return out

    def close_peer(self) -> None:
        if self.channel is not None:
            self.channel.send({"kind": "close"})
            self.channel.flush()


TransportProbeActor = ray.remote(max_concurrency=2)(TransportProbe)


def measure_transports(rows: list[int], num_features: int, reps: int = 30,
                       options_a: dict | None = None, options_b: dict | None = None) -> dict[str, Any]:
    """Round trips between two fresh probe actors (placed by `options_*`) over each point-to-point channel
    (socket, gloo) and over Ray; `*_speedup`: Ray's median round trip over the channel's, by size."""
    a = TransportProbeActor.options(**(options_a or {"num_cpus": 0})).remote()
    b = TransportProbeActor.options(**(options_b or {"num_cpus": 0})).remote()
    out: dict[str, Any] = {"num_features": num_features, "reps": reps}
    try:
        for transport in ("socket", "gloo"):
            host, port = ray.get(a.address.remote())
            ray.get([a.open.remote(transport, host, port, 0), b.open.remote(transport, host, port, 1)])
            echo = b.echo_forever.remote()
            out[transport] = ray.get(a.measure.remote(transport, None, rows, num_features, reps))
            ray.get(a.close_peer.remote())
            ray.get(echo)
        via_ray = out["ray"] = ray.get(a.measure.remote("ray", b, rows, num_features, reps))
        out["nodes"] = ray.get([a.node_id.remote(), b.node_id.remote()])
    finally:
        for actor in (a, b):
            ray.kill(actor)
    for transport in ("socket", "gloo"):
        out[f"{transport}_speedup"] = {k: via_ray[k]["rtt_ms_median"] / max(v["rtt_ms_median"], 1e-9)
                                       for k, v in out[transport].items()}
    return out
