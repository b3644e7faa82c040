"""A draft round's round trip through GlooChannel after a 2-thread compute step, the channel as before (header,
skeleton and tensors each a gloo message posted in turn) and as now (skeleton in the first part, reply's receive
posted at send): a batch-32 round of the suffix sources (no tensors) and one with DSpark's features (65 rows x 1728
bf16). The verify side frees its OpenMP team before it waits, as the shipped worker does (a 3rd argument: it does
not). `python channel_rtt.py old|new 0|1 [norelease]`; the old channel first:
`git show 5242567:dspark/actors/transport.py > /tmp/s44/old_transport.py`."""
import importlib.util
import json
import multiprocessing as mp
import statistics
import sys
import time

ROUNDS = 150
OLD = "/tmp/s44/old_transport.py"


def _module(which):
    if which == "new":
        from dspark.actors import transport
        return transport
    spec = importlib.util.spec_from_file_location("old_transport", OLD)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_transport"] = mod
    spec.loader.exec_module(mod)
    return mod


def message(features):
    import torch
    return {"kind": "draft", "seq": 0, "max_num_tokens": 7,
            "requests": [{"id": f"req-{i:032x}", "new_tokens": [11, 12, 13], "temperature": 0.0, "num_features": 0,
                          "tenant": ""} for i in range(32)],
            "features": torch.randn(65, 1728).to(torch.bfloat16) if features else None, "released": [],
            "forgone": [], "verdicts": [(f"req-{i:032x}", 3, 2) for i in range(32)]}


def reply():
    return {"tokens": [[1, 2, 3, 4, 5, 6, 7]] * 32, "probs": None,
            "confidences": [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]] * 32,
            "sources": ["corpus"] * 32, "seq": 0, "posted_s": 0.0, "received_s": 0.0, "start_s": 0.0, "end_s": 0.0}


def echo(which, port):
    import torch
    torch.set_num_threads(1)
    ch = _module(which).GlooChannel("127.0.0.1", port, 1)
    r = reply()
    for _ in range(ROUNDS):
        ch.recv()
        ch.send(r)
    ch.flush()  # the last reply is read before this process exits
    ch.recv()  # the closing message


def main(which, features):
    import torch

    from dspark.actors.transport import free_port
    from dspark.kernels import omp_teams
    torch.set_num_threads(2)
    port = free_port()
    p = mp.get_context("spawn").Process(target=echo, args=(which, port))
    p.start()
    ch = _module(which).GlooChannel("127.0.0.1", port, 0)
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
        if hasattr(ch, "expect"):
            ch.expect()
        ch.recv(on_block=omp_teams.release if len(sys.argv) < 4 else None)
        ts.append((time.perf_counter() - t0) * 1e3)
    ch.send({"kind": "close"})
    ch.flush()
    p.join()
    ts = sorted(ts[20:])
    print(json.dumps({"channel": which, "features": features, "rtt_ms_p50": round(statistics.median(ts), 3),
                      "rtt_ms_p90": round(ts[int(0.9 * len(ts))], 3)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
