"""Does the verify process's spinning OpenMP team slow the draft round trip on a 2-core box?
A: a bf16 SmolLM2 batch-1 decode step, then one draft round trip over a GlooChannel; B: the draft side
(receives, ~0.3 ms of single-thread work, replies). Arms interleaved: A's team left spinning, or released
(omp_teams.release) before the round trip."""
import json
import multiprocessing as mp
import os
import statistics
import time

WORK = os.environ.get('WORK', '1') == '1'


def drafter(port):
    import torch
    torch.set_num_threads(1)
    from dspark.actors.transport import GlooChannel
    ch = GlooChannel("127.0.0.1", port, 1)
    x = torch.randn(64, 64)
    while True:
        msg = ch.recv()
        if msg.get("stop"):
            break
        t0 = time.perf_counter()
        while WORK and time.perf_counter() - t0 < 0.0003:
            x = x @ x.T / 64
        ch.send({"tokens": [[1, 2, 3, 4, 5, 6, 7]], "seq": msg["seq"]})


def main():
    from dspark.actors.transport import GlooChannel, free_port
    port = free_port()
    p = mp.get_context("spawn").Process(target=drafter, args=(port,))
    p.start()
    import torch
    torch.set_num_threads(2)
    from dspark.kernels import omp_teams
    from dspark.models.target.layer import SeqChunk
    from dspark.models.target.loader import load_target
    from dspark.models.target.runner import TargetRunner
    ch = GlooChannel("127.0.0.1", port, 0)
    r = TargetRunner(load_target("smollm2-135m-instruct", dtype="bf16").model, 4, 1024)
    r.forward([SeqChunk(0, 0, list(range(100, 300)), 1)])
    res = {"spinning": {"rtt": [], "step": []}, "released": {"rtt": [], "step": []}}
    feats = torch.zeros(1, 3 * 576)
    for i in range(240):
        arm = "spinning" if i % 2 == 0 else "released"
        t0 = time.perf_counter()
        r.forward([SeqChunk(0, 200, [42], 1)])
        t1 = time.perf_counter()
        if arm == "released":
            omp_teams.release()
        t2 = time.perf_counter()
        ch.send({"seq": i, "requests": [{"id": "a", "new_tokens": [5]}], "features": feats})
        ch.recv()
        t3 = time.perf_counter()
        res[arm]["step"].append((t1 - t0) * 1e3)
        res[arm]["rtt"].append((t3 - t2) * 1e3)
        res[arm].setdefault("release", []).append((t2 - t1) * 1e3)
    ch.send({"stop": True})
    p.join()
    out = {arm: {k: round(statistics.median(v[10:]), 3) for k, v in d.items()} for arm, d in res.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
