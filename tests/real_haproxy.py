"""A real HAProxy serving a config a test writes: Ray Serve's generated config in miniature (the same sections, a
frontend `http_frontend`), with the front door's rules added by `add_rules` as the wrapper adds them."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from dspark.cluster.ingress.front_door import haproxy_binary

needs_haproxy = pytest.mark.skipif(haproxy_binary() is None and not os.environ.get("DSPARK_REQUIRE_HAPROXY"),
                                   reason="Debian package `haproxy` is not installed (apt-get install haproxy)")

HEAD = """global
    maxconn {maxconn}
defaults
    mode http
    timeout connect 5s
    timeout client {timeout}
    timeout server {timeout}
frontend http_frontend
    bind 127.0.0.1:{port}
"""


@contextmanager
def real_haproxy(config: str, folder: Path) -> Iterator[None]:
    """HAProxy on `config` (checked by `haproxy -c` first) until the block ends."""
    path = folder / "haproxy.cfg"
    path.write_text(config)
    binary = haproxy_binary()
    check = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen([binary, "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def first_answer(request: Callable[[], httpx.Response], timeout_s: float = 10.0) -> httpx.Response:
    """`request`'s response once HAProxy listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return request()
        except httpx.TransportError:
            assert time.monotonic() < deadline, "haproxy did not start"
            time.sleep(0.1)
