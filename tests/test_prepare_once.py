"""First start on a fresh machine: what replicas prepare is done once per machine, under a lock, and an
interrupted preparation leaves nothing that breaks the next start (kernels/cache_once.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.kernels import cache_once
from dspark.models.target.loader import DEFAULT_TARGET, is_complete_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _spawn(code: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, str]]:
    outputs = [p.communicate(timeout=timeout_s) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def test_the_lock_lets_one_process_at_a_time_through(tmp_path: Path) -> None:
    code = ("import os, time\nfrom pathlib import Path\nfrom dspark.kernels import cache_once\n"
            f"log = Path({str(tmp_path / 'log')!r})\n"
            "with cache_once.locked('x'):\n"
            "    with open(log, 'a') as f: f.write(f'in {os.getpid()}\\n')\n"
            "    time.sleep(0.3)\n"
            "    with open(log, 'a') as f: f.write(f'out {os.getpid()}\\n')\n")
    results = _finish([_spawn(code, {"DSPARK_CACHE": str(tmp_path)}) for _ in range(3)], 120)
    assert all(rc == 0 for rc, _, _ in results), results
    lines = (tmp_path / "log").read_text().splitlines()
    visits = [lines[i:i + 2] for i in range(0, len(lines), 2)]  # each in is followed by its own out
    assert len(visits) == 3 and all(a == b.replace("out", "in") and a.startswith("in") for a, b in visits), lines


def test_a_concurrent_winner_stands_and_the_loser_is_discarded(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    mine = cache_once.tmp_path(dest)
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    assert cache_once.publish_dir(mine, dest) is False
    assert not mine.exists() and json.loads((dest / "config.json").read_text()) == {}


def test_leftovers_of_dead_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    dead = dest.with_name(f"model{cache_once.TMP_MARK}999999999-dead")  # no such pid
    live = cache_once.tmp_path(dest)  # this process's own, still being written
    old_style = dest.with_suffix(".tmp")  # what the fixed-name rename of earlier versions left
    for path in (dead, live, old_style):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"partial")
    removed = cache_once.remove_stale(dest)
    assert set(removed) == {dead, old_style} and live.exists()


def test_an_unwritable_cache_names_dspark_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE", "/sys/dspark-cache")  # EPERM, even for root
    with pytest.raises(cache_once.PrepareError, match="DSPARK_CACHE"):
        with cache_once.locked("x"):
            pass


def test_a_full_disk_names_the_cause_and_the_fix() -> None:
    line = cache_once.explain(OSError(28, "No space left on device"), "converting")
    assert "no space left" in line and "DSPARK_CACHE" in line and "\n" not in line


@pytest.mark.slow
def test_concurrent_first_starts_convert_once_and_repair_an_interrupted_one(tmp_path: Path) -> None:
    """Three processes resolve the embedded target on a cache an earlier run was killed in: a partial
    model folder (no config.json), its own temporary folder and the old fixed-name `.tmp` one. One of them
    converts (once), all succeed, and nothing temporary is left."""
    models = tmp_path / "models"
    out = models / DEFAULT_TARGET
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"\0" * 64)  # killed while writing: no config.json
    for leftover in (out.with_suffix(".tmp"), out.with_name(f"{out.name}{cache_once.TMP_MARK}999999999-dead")):
        leftover.mkdir()
        (leftover / "config.json").write_text("{")
    code = ("import logging\nlogging.basicConfig(level=logging.INFO)\n"
            "from dspark.models.target.loader import resolve_target_path, DEFAULT_TARGET\n"
            "print(resolve_target_path(DEFAULT_TARGET))\n")
    t0 = time.perf_counter()
    results = _finish([_spawn(code, {"DSPARK_CACHE": str(tmp_path)}) for _ in range(3)], 600)
    assert all(rc == 0 for rc, _, _ in results), [err[-2000:] for _, _, err in results]
    assert {o.strip() for _, o, _ in results} == {str(out)}
    num_conversions = sum(err.count("converting SmolLM2") for _, _, err in results)
    assert num_conversions == 1, [err[-2000:] for _, _, err in results]
    assert is_complete_checkpoint(out)
    assert sorted(p.name for p in models.iterdir()) == [DEFAULT_TARGET], list(models.iterdir())
    print(f"3 concurrent first starts: {time.perf_counter() - t0:.1f} s")
