"""channel_rtt.py's measurement over SocketChannel or GlooChannel: python sock_rtt.py socket|gloo 0|1"""
import json, multiprocessing as mp, statistics, sys, time
sys.path.insert(0, "docs/results/suffix/s44")
from channel_rtt import message, reply, ROUNDS

def cls(which):
    if which == "socket":
        from dspark.actors.socket_channel import SocketChannel
        return SocketChannel
    from dspark.actors.transport import GlooChannel
    return GlooChannel

def echo(which, port):
    import torch
    torch.set_num_threads(1)
    ch = cls(which)("127.0.0.1", port, 1)
    r = reply()
    for _ in range(ROUNDS):
        ch.recv()
        ch.send(r)
    ch.flush()
    ch.recv()

def main(which, features):
    import torch
    from dspark.actors.transport import free_port
    from dspark.kernels import omp_teams
    torch.set_num_threads(2)
    port = free_port()
    p = mp.get_context("spawn").Process(target=echo, args=(which, port))
    p.start()
    ch = cls(which)("127.0.0.1", port, 0)
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
    print(json.dumps({"channel": which, "features": features, "rtt_ms_p50": round(statistics.median(ts), 3), "rtt_ms_p90": round(ts[int(0.9 * len(ts))], 3)}))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
