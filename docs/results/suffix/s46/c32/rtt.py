"""Round trip of a 32-request hybrid draft round between a verify-side and a draft-side process (the draft side a
real DraftService with the shipped hybrid), both otherwise idle. From the repo root:
RTT_KIND=gloo|socket RTT_NOISE=<bursty neighbour processes> RTT_HOG_MS=<GIL held after each send>
RTT_SWITCH=<sys.setswitchinterval s> python docs/results/suffix/s46/c32/rtt.py"""

import json
import os
import statistics as st
import sys
import time

import torch
import torch.multiprocessing as mp

from dspark.actors.transport import GlooChannel, free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sockchan.py beside this script
from sockchan import SocketChannel

KIND = os.environ.get("RTT_KIND", "gloo")
Chan = GlooChannel if KIND == "gloo" else SocketChannel

PORT = int(os.environ.setdefault("RTT_PORT", str(free_port())))


def draft_side():
    from dspark.draft_service.service import DraftService, serve_channel
    from dspark.models.drafters.registry import make_drafter
    from dspark.models.target.loader import load_target

    os.nice(10)
    torch.set_num_threads(1)
    target = load_target("smollm2-135m-instruct", "cpu", "bf16")
    drafter = make_drafter("hybrid", target, sources=["request", "corpus"])
    svc = DraftService(drafter)
    ch = Chan("127.0.0.1", PORT, 1)
    serve_channel(ch, svc)
    spans = svc.timeline()
    print("draft handle ms", round(st.median((s["end_s"] - s["start_s"]) * 1e3 for s in spans[5:]), 2), flush=True)


def burst():
    import random

    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0006:
            pass
        time.sleep(0.0044 * random.random() * 2)


def main():
    from transformers import AutoTokenizer

    from dspark.draft_service.client import RemoteDrafter
    from dspark.models.drafters.base import DraftRequest
    from dspark.models.target.loader import resolve_target_path

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
    prompts = [json.loads(lv) for lv in open("../shared/data/eval/humaneval.jsonl")][:16] + [
        json.loads(lv) for lv in open("../shared/data/eval/gsm8k.jsonl")
    ][:16]
    ids = [tok(str(p.get("prompt") or p.get("question") or p.get("turns")))["input_ids"][:300] for p in prompts]
    p = mp.get_context("spawn").Process(target=draft_side)
    p.start()
    os.nice(10)
    noise = [
        mp.get_context("spawn").Process(target=burst, daemon=True) for _ in range(int(os.environ.get("RTT_NOISE", "0")))
    ]
    [q.start() for q in noise]
    ch = Chan("127.0.0.1", PORT, 0)
    hidden = (2, 15, 28)
    sys.setswitchinterval(float(os.environ.get("RTT_SWITCH", "0.005")))
    rd = RemoteDrafter(ch, hidden, name="hybrid")
    import threading

    global HOG, hog_go
    HOG = float(os.environ.get("RTT_HOG_MS", "0")) / 1e3
    hog_go = threading.Event()

    def hog():
        while True:
            hog_go.wait()
            hog_go.clear()
            t = time.perf_counter()
            while time.perf_counter() - t < HOG:
                sum(range(200))

    threading.Thread(target=hog, daemon=True).start()
    times = []
    rng = torch.Generator().manual_seed(0)
    for step in range(60):
        reqs = []
        for i, t in enumerate(ids):
            if step:
                t.extend(torch.randint(0, 49000, (2,), generator=rng).tolist())
            # features of the tokens that entered the cache: 2 a step, 3 layers x 576
            rd.observe(f"r{i}", torch.randn(len(t) - 1 if step == 0 else 2, len(hidden) * 576).to(torch.bfloat16))
            reqs.append(DraftRequest(f"r{i}", list(t), 0.0, ""))
        t0 = time.perf_counter()
        rd.submit(reqs, 7)
        if HOG:
            hog_go.set()
        out = rd.collect()
        times.append((time.perf_counter() - t0) * 1e3)
        rd.feedback([r.request_id for r in reqs], [len(x) for x in out.tokens], [min(1, len(x)) for x in out.tokens])
    spans = list(rd.spans)[5:]
    print(
        "round trip ms median",
        round(st.median(times[5:]), 2),
        "transport",
        round(st.median(s.transport_ms for s in spans), 2),
        "draft",
        round(st.median((s.draft_end_s - s.draft_start_s) * 1e3 for s in spans), 2),
        flush=True,
    )
    ch.send({"kind": "close"})
    p.join()
    [q.terminate() for q in noise]


if __name__ == "__main__":
    main()
