"""Work done once per machine into the cache (``$DSPARK_CACHE``): a cross-process lock and atomic publish.

A fresh machine starts several replicas at once (verify and draft pools, the ingress), and each of them
needs the same prepared files: the converted target, the native kernels, GEMM plans, the dtype choice,
the SPS profile. Without coordination every replica did the work, and renames of one fixed temporary
name collided ("Directory not empty"). So:
- `locked(name)`: an exclusive `fcntl.flock` on ``<cache>/locks/<name>.lock`` around check-then-prepare;
  the kernel drops the lock when its holder dies, so a killed preparation never blocks the next one;
- `publish_file` / `publish_dir`: write to a temporary name unique to this process, then rename into
  place; where a concurrent winner got there first, its copy stands and ours is discarded;
- `remove_stale`: what an interrupted run left (temporary names of processes that are gone) is
  removed under the lock, so the next start repairs itself;
- `explain`: one line that names the cause and the fix of a failed preparation (disk full, cache not
  writable, package missing), for a replica's constructor to raise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp-"  # <name>.tmp-<pid>-<hex>: whose it is, so leftovers of dead processes are known


class PrepareError(RuntimeError):
    """A preparation that cannot succeed on this machine as it is; the message names cause and fix."""


def cache_dir() -> Path:
    """Root of dspark's on-disk cache (``$DSPARK_CACHE`` or ``~/.cache/dspark``)."""
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def cache_root() -> Path:
    return cache_dir()


@contextlib.contextmanager
def locked(name: str, root: Path | None = None) -> Iterator[None]:
    """Hold the machine-wide lock `name` (blocking) for the block: one process prepares, the others wait
    and then find the result."""
    lock_dir = (root or cache_root()) / "locks"
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_dir / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise PrepareError(explain(exc, f"locking {lock_dir / name}")) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def tmp_path(dest: Path) -> Path:
    """A temporary sibling of `dest` that no other process uses."""
    return dest.with_name(f"{dest.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(dest: Path) -> list[Path]:
    """Remove temporary siblings of `dest` whose process is gone (and the old fixed-name ``<dest>.tmp``);
    call it under the lock. Returns what was removed."""
    removed = []
    if not dest.parent.is_dir():
        return removed
    for path in dest.parent.iterdir():
        name = path.name
        if name == f"{dest.name}.tmp" or name == dest.with_suffix(".tmp").name:
            is_stale = True
        elif name.startswith(f"{dest.name}{TMP_MARK}"):
            pid = name[len(dest.name) + len(TMP_MARK):].split("-", 1)[0]
            is_stale = not pid.isdigit() or not _is_alive(int(pid))
        else:
            continue
        if is_stale:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def publish_file(dest: Path, data: bytes | str) -> Path:
    """Write `data` to `dest` atomically (a reader sees the whole file or none)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(dest)
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        tmp.replace(dest)  # a concurrent writer of the same content: the last rename wins, both whole
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def publish_json(dest: Path, obj: object) -> Path:
    return publish_file(dest, json.dumps(obj, indent=1))


def read_json(path: Path) -> dict | None:
    """A cached JSON file, or None when it is absent or unreadable (a corrupt cache is measured again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def publish_dir(tmp: Path, dest: Path) -> bool:
    """Rename the finished folder `tmp` to `dest`. False (and `tmp` removed) when a concurrent winner put
    one there first: its copy stands."""
    try:
        os.rename(tmp, dest)
        return True
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def explain(exc: BaseException, doing: str) -> str:
    """One line: what failed while `doing`, why, and what to do about it."""
    root = cache_root()
    if isinstance(exc, PrepareError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return (f"{doing}: no space left on the device of {root}; free ~1 GB there or point "
                f"DSPARK_CACHE at a disk with room")
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"{doing}: the cache {root} is not writable ({exc.strerror}); set DSPARK_CACHE to a writable "
                f"folder")
    if isinstance(exc, ModuleNotFoundError) or (isinstance(exc, FileNotFoundError) and "pip install" in str(exc)):
        return f"{doing}: {exc} (a missing package: install it in this environment, e.g. `make serve` does)"
    return f"{doing}: {type(exc).__name__}: {exc}"

