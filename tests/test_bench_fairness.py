"""The fairness tools of `bench serve`: the peer's process tree really pauses, and the CPU meter puts a
busy process's time in the right group."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from dspark.bench.cpu_time import cores_used, snapshot
from dspark.bench.peer_process import paused
from dspark.bench.serve_fairness import fairness_summary, interference

SPIN = "import os, time\nif os.fork() == 0:\n    pass\nt = time.time()\nwhile time.time() - t < 60:\n    pass\n"


def test_a_paused_peer_tree_uses_no_cpu_and_runs_again_after() -> None:
    peer = subprocess.Popen([sys.executable, "-c", SPIN])  # a parent and a forked child, both spinning
    try:
        time.sleep(0.5)
        tree = [psutil.Process(peer.pid), *psutil.Process(peer.pid).children(recursive=True)]
        assert len(tree) == 2
        with paused(peer.pid) as n:
            assert n == 2
            time.sleep(0.3)
            assert all(p.status() == psutil.STATUS_STOPPED for p in tree)
            before = snapshot(peer_pid=peer.pid)
            time.sleep(1.0)
            used = cores_used(before, snapshot(peer_pid=peer.pid))
            assert used.get("peer", 0.0) < 0.05, used
        before = snapshot(peer_pid=peer.pid)
        time.sleep(1.0)
        used = cores_used(before, snapshot(peer_pid=peer.pid))
        assert used["peer"] > 0.5, used  # two spinning processes on (at least) one free core
        assert all(p.status() != psutil.STATUS_STOPPED for p in tree)
    finally:
        for p in psutil.Process(peer.pid).children(recursive=True):
            p.kill()
        peer.kill()
        peer.wait()


def test_paused_continues_the_peer_when_the_body_fails() -> None:
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        try:
            with paused(peer.pid):
                raise RuntimeError("the arm failed")
        except RuntimeError:
            pass
        assert psutil.Process(peer.pid).status() != psutil.STATUS_STOPPED
    finally:
        peer.kill()
        peer.wait()


def test_fairness_summary_compares_alone_with_interleaved_against_the_pass_noise() -> None:
    def level(c: int, tok_s: float, passes: list[float] | None = None) -> dict:
        lv = {"concurrency": c, "output_throughput_tok_s": tok_s, "tps_user_median": tok_s / c, "ttft_p50_s": 0.1}
        if passes is not None:
            lv.update(pass_throughput_tok_s=passes,
                      pass_cores_by_group=[{"arm:a": 1.5, "arm:b": 0.2, "ray": 0.1, "machine": 1.9}] * 2)
        return lv

    result = {"arms": {"a": {"levels": [level(1, 10.0, [9.0, 11.0]), level(4, 20.0, [20.0, 20.2])],
                             "alone_levels": [level(1, 10.8), level(4, 24.0)]}}}
    fair = fairness_summary(result)
    one, four = fair["levels"]["a"]["1"], fair["levels"]["a"]["4"]
    assert one["noise"] == 0.2 and one["alone_over_interleaved"] == 1.08 and one["agree_within_noise"]
    assert four["noise"] == 0.05 and four["alone_over_interleaved"] == 1.2 and not four["agree_within_noise"]
    assert four["interference_cores"] == [0.3, 0.3]
    assert not fair["all_agree_within_noise"]
    # the alone level's own two passes count toward the noise too (it runs them as the interleaved passes)
    result["arms"]["a"]["alone_levels"][1] = level(4, 24.0, [21.0, 27.0])
    assert fairness_summary(result)["levels"]["a"]["4"]["noise"] == pytest.approx(0.25)
    assert interference({"arm:a": 1.0, "load generator": 0.2, "peer": 0.4, "machine": 1.6}, "a") == 0.4
