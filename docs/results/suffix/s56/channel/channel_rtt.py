"""Session 56: s44's `channel_rtt.py` measurement over either point-to-point channel. A batch-32 draft round of the
hybrid (no tensors; 1: with DSpark's features, 65 x 1728 bf16) echoed by another process after a 20 ms 2-thread bf16
step, the verify side's OpenMP team freed before it waits (as the shipped worker does); 150 rounds, the first 20
left out. One JSON line: p50 / p90 ms.
    .venv/bin/python docs/results/suffix/s56/channel/channel_rtt.py socket|gloo 0|1"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time

sys.path.insert(0, "docs/results/suffix/s44")
from channel_rtt import ROUNDS, message, reply  # noqa: E402 - s44's messages, shared


def echo(which: str, port: int) -> None:
    import torch

    from dspark.actors.transport import open_channel
    torch.set_num_threads(1)
    ch = open_channel(which, "127.0.0.1", port, 1)
    r = reply()
    for _ in range(ROUNDS):
        ch.recv()
        ch.send(r)
    ch.flush()
    ch.recv()


def main(which: str, features: bool) -> None:
    import torch

    from dspark.actors.transport import free_port, open_channel
    from dspark.kernels import omp_teams
    torch.set_num_threads(2)
    port = free_port()
    p = mp.get_context("spawn").Process(target=echo, args=(which, port))
    p.start()
    ch = open_channel(which, "127.0.0.1", port, 0)
    a = torch.randn(32, 576, dtype=torch.bfloat16)
    w = torch.randn(576, 4096, dtype=torch.bfloat16)
    ts = []
    for _ in range(ROUNDS):
        t_end = time.perf_counter() + 0.02
        while time.perf_counter() < t_end:
            a @ w
        m = message(features)
        t0 = time.perf_counter()
        ch.send(m)
        ch.expect()
        ch.recv(on_block=omp_teams.release)
        ts.append((time.perf_counter() - t0) * 1e3)
    ch.send({"kind": "close"})
    ch.flush()
    p.join()
    ts = sorted(ts[20:])
    print(json.dumps({"channel": which, "features": features, "rtt_ms_p50": round(statistics.median(ts), 3),
                      "rtt_ms_p90": round(ts[int(0.9 * len(ts))], 3)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
