"""The engine computes with the thread count it was given, on its own loop thread, in a worker whose
OMP_NUM_THREADS was set before it started (Ray sets it to a worker's whole CPUs: 1 for a 1.5-CPU replica).

torch.set_num_threads sizes OpenMP's team for the calling thread only; a thread started later gets
OMP_NUM_THREADS until PyTorch's first parallel op on it re-applies the count set (its lazy per-thread init).
The engine's loop thread relies on that: this guards it (a plain thread's MKL GEMMs run on one core)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, ctypes, glob, json, os, sys, threading
import torch
from dspark.config.engine import EngineConfig
from dspark.verify_service.async_engine import AsyncEngine
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

libs = [p for pat in ("libgomp*", "libiomp*", "libomp*")
        for p in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", pat))]
if not libs:
    print(json.dumps({"skip": "torch has no OpenMP runtime of its own here"})); sys.exit(0)
omp = ctypes.CDLL(libs[0])
torch.set_num_threads(2)
plain = []
t = threading.Thread(target=lambda: plain.append(omp.omp_get_max_threads())); t.start(); t.join()
engine = Engine(EngineConfig(target=sys.argv[1], drafter="none", scheduler="fixed", num_draft_tokens=0,
                             max_num_seqs=1, max_model_len=64))
seen = []
front = AsyncEngine(engine, on_step=lambda: seen.append(omp.omp_get_max_threads()))

async def main():
    async for _ in front.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)):
        pass

asyncio.run(main())
front.shutdown()
print(json.dumps({"plain_thread": plain[0], "engine_thread": sorted(set(seen))}))
"""


def test_the_engine_thread_computes_with_the_threads_set_not_omp_num_threads(tiny_target_dir: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_target_dir)], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in res:
        import pytest

        pytest.skip(res["skip"])
    assert res["plain_thread"] == 1  # what any thread started without it gets (the premise)
    assert res["engine_thread"] == [2]


RELEASE = r"""
import json, os, time
import torch
from dspark.kernels import omp_teams

def tasks():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
a = torch.randn(256, 256)
before = tasks()
a @ a  # a parallel region: this thread's team (one more thread) from now on
with_team = tasks()
released = omp_teams.release()
time.sleep(0.2)
after = tasks()
again = float((a @ a).sum()) == float((a @ a).sum())  # a region after the release builds its team again
print(json.dumps({"before": before, "with_team": with_team, "released": released, "after": after,
                  "again": again, "rebuilt": tasks()}))
"""


def test_releasing_openmp_teams_ends_their_threads_and_later_regions_still_run() -> None:
    """What the engine loop does before it starts (see dspark/kernels/omp_teams.py): the loading thread's
    team of OpenMP workers ends, so the loop thread's team is the only one (GNU OpenMP stops spin-waiting
    where teams outnumber the cores)."""
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["released"]:
        import pytest

        pytest.skip("this OpenMP runtime cannot release its teams (pre-5.0, or none)")
    assert res["with_team"] > res["before"]
    assert res["after"] == res["before"]
    assert res["again"] and res["rebuilt"] == res["with_team"]
