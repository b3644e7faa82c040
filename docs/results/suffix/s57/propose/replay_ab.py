"""Session 57: the hybrid's whole proposal round (Python around the native call included) of a base commit against
this checkout's, in ONE process, on recorded rounds (`record_rounds.py`). The base's `suffix/index.py`,
`suffix/drafter.py` and `hybrid.py` are loaded from git under another package name (their imports of each other
rewritten; everything else is this checkout's), both drafters built the same way, DSpark out (features forgone,
as the gate leaves it on a Zen 4). Rounds alternate A B / B A; each round is timed cold (256 MB read before it, as
a forward leaves the caches) and again at once (hot), then given an all-zero verdict; the two drafters' outputs
(tokens, confidences, sources, q) are compared round by round. Per temperature (0, and 1 on the same contexts)
the median ms a round. One JSON line.
    .venv/bin/python docs/results/suffix/s57/propose/replay_ab.py ROUNDS BASE_COMMIT [PASSES]"""

from __future__ import annotations

import importlib
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.hybrid import HybridDrafter
from dspark.models.target.loader import load_target

ROUNDS = pickle.load(open(sys.argv[1], "rb"))
BASE = sys.argv[2]
PASSES = int(sys.argv[3]) if len(sys.argv) > 3 else 2
FILES = {"index": "dspark/models/drafters/suffix/index.py", "drafter": "dspark/models/drafters/suffix/drafter.py",
         "hybrid": "dspark/models/drafters/hybrid.py"}
root = Path(tempfile.mkdtemp()) / "s57base"
root.mkdir()
(root / "__init__.py").write_text("")
for name, path in FILES.items():
    text = subprocess.run(["git", "show", f"{BASE}:{path}"], capture_output=True, text=True, check=True).stdout
    text = text.replace("dspark.models.drafters.suffix.index", "s57base.index")
    text = text.replace("dspark.models.drafters.suffix.drafter", "s57base.drafter")
    text = text.replace("Path(__file__).resolve().parents[4]", f"Path({str(Path.cwd())!r})")  # this checkout's
    (root / f"{name}.py").write_text(text)
sys.path.insert(0, str(root.parent))
base_hybrid = importlib.import_module("s57base.hybrid")
torch.set_num_threads(2)
target = load_target(dtype="bf16")
drafters = {"base": base_hybrid.HybridDrafter.build(target), "head": HybridDrafter.build(target)}
ids = {r[0] for rnd in ROUNDS for r in rnd}
for d in drafters.values():
    for rid in ids:
        d.forgo_features(rid)
sweep = np.ones(2**26, dtype=np.float32)


def one(drafter, reqs: list[DraftRequest], verdict: tuple[int, int] = (0, 0)):  # noqa: ANN001, ANN202
    t0 = time.perf_counter()
    out = drafter.propose(reqs, 7)
    t1 = time.perf_counter()
    drafter.feedback([r.request_id for r in reqs], [verdict[0]] * len(reqs), [verdict[1]] * len(reqs))
    return (t1 - t0) * 1e3, out, (time.perf_counter() - t1) * 1e3


def same(a, b) -> bool:  # noqa: ANN001
    if (a.tokens, a.confidences, a.sources) != (b.tokens, b.confidences, b.sources):
        return False
    if (a.probs is None) != (b.probs is None):
        return False
    return a.probs is None or all(np.array_equal(x.tokens, y.tokens) and np.array_equal(x.probs, y.probs)
                                  for x, y in zip(a.probs, b.probs))


result: dict = {"cpu": cpu_signature(), "base": BASE, "requests": len(ROUNDS[0]), "rounds": len(ROUNDS)}
identical = True
for temperature in (0.0, 1.0):
    batches = [[DraftRequest(rid, toks, temperature, tenant) for rid, toks, tenant in rnd] for rnd in ROUNDS]
    hot: dict[str, list[float]] = {n: [] for n in drafters}
    cold: dict[str, list[float]] = {n: [] for n in drafters}
    feedback: dict[str, list[float]] = {n: [] for n in drafters}
    for reqs in batches:  # warm-up: texts synced, tables read
        for d in drafters.values():
            one(d, reqs)
    for p in range(PASSES):
        for k, reqs in enumerate(batches):
            outs = {}
            for name in (["base", "head"] if (k + p) % 2 == 0 else ["head", "base"]):
                sweep.sum()
                ms, outs[name], _ = one(drafters[name], reqs)
                cold[name].append(ms)
                ms, _, fb_ms = one(drafters[name], reqs, (3, 1))  # every request verified 3, accepted 1
                hot[name].append(ms)
                feedback[name].append(fb_ms)
            identical &= same(outs["base"], outs["head"])
    med = {n: (statistics.median(hot[n]), statistics.median(cold[n])) for n in drafters}
    result[f"t{temperature:g}"] = {**{f"{n}_hot_ms": round(v[0], 3) for n, v in med.items()},
                                   **{f"{n}_cold_ms": round(v[1], 3) for n, v in med.items()},
                                   **{f"{n}_feedback_ms": round(statistics.median(feedback[n]), 3) for n in drafters},
                                   "hot_head_over_base": round(med["head"][0] / med["base"][0], 3),
                                   "cold_head_over_base": round(med["head"][1] / med["base"][1], 3)}
result["outputs_identical"] = identical
print(json.dumps(result))
