"""The cluster's front door: what accepts client connections and hands requests to the ingress replicas.

`proxy`: Ray Serve's ProxyActor (Python) parses HTTP and forwards every request, and every streamed chunk,
to an ingress replica over a Ray call: one more Python process and one more hop per token.

`haproxy`: Ray Serve's direct ingress behind HAProxy. Each ingress replica runs its own HTTP server and
HAProxy (C) balances connections across them, health-checks them and drops a dead one. Measured here
(`dspark bench overload`, shipped config, 2-core Xeon): the per-request CPU of the ProxyActor (~4 ms) is
gone, the ingress's own falls from ~4.3 to ~2.8 ms, and refusals at 10x capacity answer in 2–3 ms at
p50 instead of 25–45 ms. Admission, 429s and API keys stay in the ingress replica (`ingress/guard.py`, `routes.py`), the
same code on either door; and with HAProxy a burst past the limit the ingress publishes is refused by HAProxy
itself (429 + Retry-After, `front_door_rules.py`): Serve's HAProxy binary is a wrapper that adds those rules
to the config Serve generates, then runs the real haproxy.

Either door also starts Ray's workers at niceness 0 (`cpu_priority.REQUEST_PATH_ENV`), so the ingress
runs above the pools on shared cores; HAProxy puts itself above both (`front_door_rules.raise_priority`).

Ray reads these switches from the environment of the process that starts the cluster (its controller and
replicas inherit it), so they are set before `ray.init` / `serve run`: `make serve` runs
`python -m dspark.cluster.ingress.front_door` to get them; the benches call `use_front_door`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from dspark.config.cpu_priority import REQUEST_PATH_ENV

FrontDoor = Literal["auto", "haproxy", "proxy"]


def haproxy_binary() -> str | None:
    return os.environ.get("DSPARK_HAPROXY") or shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)


def wrapper_binary() -> str:
    """An executable that adds the front-door rules to Serve's HAProxy config and runs the real haproxy
    (front_door_rules.py); written once per machine and interpreter, kept if unchanged."""
    real = haproxy_binary()
    rules = Path(__file__).with_name("front_door_rules.py").resolve()
    folder = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "front_door"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "haproxy"
    script = f'#!/bin/sh\nexec "{sys.executable}" -I -S "{rules}" "{real}" "$@"\n'
    if not path.exists() or path.read_text() != script:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(script)
        tmp.chmod(0o755)
        tmp.replace(path)
    return str(path)


def resolve(kind: FrontDoor) -> Literal["haproxy", "proxy"]:
    """auto: HAProxy when its binary is installed, else Serve's proxy."""
    if kind == "auto":
        return "haproxy" if haproxy_binary() else "proxy"
    if kind == "haproxy" and not haproxy_binary():
        raise RuntimeError("front door haproxy: no haproxy binary (apt-get install haproxy, or set DSPARK_HAPROXY)")
    return kind


# Serve's controller reconciles every 0.1 s by default: idle, it and the GCS it talks to took 4.8% of a core
# of an idle one-app cluster's 9.9% (2-core Xeon); at 0.5 s 2.0% of 6.6%. Scaling and routing changes then
# reach the replicas and HAProxy within half a second, against replica starts of seconds.
IDLE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}

# every variable front_door_env may set: what switching doors (and restoring) has to cover
KEYS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BINARY_PATH",
        "RAY_SERVE_HAPROXY_NBTHREAD", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
        *REQUEST_PATH_ENV, *IDLE_ENV)


def front_door_env(kind: FrontDoor = "auto") -> dict[str, str]:
    """The environment that selects `kind` (for Serve's own proxy: only the request path's CPU priority and the
    controller's idle interval)."""
    if resolve(kind) == "proxy":
        return {**REQUEST_PATH_ENV, **IDLE_ENV}
    return {**REQUEST_PATH_ENV, **IDLE_ENV,
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        # the real haproxy, behind a wrapper that adds the rules refusing bursts at the door (front_door_rules.py)
        "RAY_SERVE_HAPROXY_BINARY_PATH": wrapper_binary(),
        # HAProxy's threads only move bytes: one per two cores (its default of 4 competes with the model here)
        "RAY_SERVE_HAPROXY_NBTHREAD": str(max(1, min(4, (os.cpu_count() or 2) // 2))),
        # a stopped replica drains for this long before it goes (Serve's default, 30 s, is for external
        # load balancers; HAProxy is told at once)
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    }


def use_front_door(kind: FrontDoor = "auto") -> str:
    """Select the front door for the clusters this process starts from now on; returns the one chosen."""
    env = front_door_env(kind)
    for key in KEYS:
        os.environ.pop(key, None)
    os.environ.update(env)
    return resolve(kind)


@contextlib.contextmanager
def front_door_environment(kind: FrontDoor = "auto") -> Iterator[str]:
    """`use_front_door` for the clusters started inside the block; the environment is restored after."""
    saved = {k: os.environ.get(k) for k in KEYS}
    try:
        yield use_front_door(kind)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    """`python -m dspark.cluster.ingress.front_door [auto|haproxy|proxy]`: KEY=VALUE words for `env`."""
    kind = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DSPARK_FRONT_DOOR", "auto")
    if kind not in ("auto", "haproxy", "proxy"):
        sys.exit(f"front door must be auto, haproxy or proxy, got {kind!r}")
    env = front_door_env(kind)  # type: ignore[arg-type]
    door = resolve(kind)  # type: ignore[arg-type]
    print(f"front door: {'haproxy (Serve direct ingress)' if door == 'haproxy' else 'Serve proxy'}", file=sys.stderr)
    print(" ".join(f"{k}={v}" for k, v in env.items()))


if __name__ == "__main__":
    main()
