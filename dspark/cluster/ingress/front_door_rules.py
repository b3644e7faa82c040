"""HAProxy refuses a burst itself: rules added to the config Ray Serve generates, by the limit the ingress publishes.

Every response of the generate routes carries the ingress replica's admission limit (requests in flight it
admits within the SLA, all arms, plus a small slack) and its predicted wait (`x-dspark-admit-limit`,
`x-dspark-retry-after`, admission_gate.py). HAProxy keeps the last of each in a process variable per
backend and strips them from the response; a new generate request is answered by HAProxy itself, 429 with
`Retry-After` and an OpenAI-style body (and `x-dspark-refused-by: front-door`), while the backend already
holds that many requests (`be_conn`, times the backend's usable servers). Nothing Python runs for it: a burst
of thousands costs HAProxy's speed. Until the first response after a (re)start HAProxy knows no limit and
forwards everything; admission in the ingress refuses as before. The limit is never below 1 per replica, so
an idle backend always lets a request through, whose response brings the current limit.

Ray Serve writes its HAProxy config itself (no hook), so `front_door.py` points Serve's HAProxy binary at a
small wrapper script that runs this file: it adds the rules to the config named by `-f` (in place, under
Ray's own lock file, idempotently) and then execs the real haproxy with the same arguments, so the process,
its command line and Ray's reload protocol (`-sf`, `-x`) are unchanged. Stdlib only: it runs before any
package is importable, with `python -S`.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys

MARKER = "# dspark front door"
LIMIT_HEADER = "x-dspark-admit-limit"
RETRY_HEADER = "x-dspark-retry-after"
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
WARMING_BODY = ('{\\"error\\":{\\"message\\":\\"the server is starting; retry later\\",'
                '\\"type\\":\\"service_unavailable_error\\",\\"param\\":null,\\"code\\":\\"warming_up\\"}}')
BODY = ('{\\"error\\":{\\"message\\":\\"the server is at capacity; retry later\\",'
        '\\"type\\":\\"rate_limit_error\\",\\"param\\":null,\\"code\\":\\"overloaded\\"}}')


def _var(backend: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", backend)


def frontend_rules(backend: str) -> list[str]:
    v = _var(backend)
    return [
        f"    {MARKER}: refuse generate requests past the limit the ingress publishes ({backend})",
        f"    http-request set-var(txn.dspark_busy_{v}) be_conn({backend}) if dspark_generate is_{backend}",
        f"    http-request set-var(txn.dspark_room_{v}) nbsrv({backend}),mul(proc.dspark_limit_{v}),"
        f"sub(txn.dspark_busy_{v}) if dspark_generate is_{backend} {{ var(proc.dspark_limit_{v}) -m found }}",
        f"    http-request return status 429 content-type application/json "
        f"hdr Retry-After \"%[var(proc.dspark_retry_{v})]\" hdr x-dspark-refused-by front-door "
        f"string \"{BODY}\" if dspark_generate is_{backend} {{ var(txn.dspark_room_{v}) -m found }} "
        f"{{ var(txn.dspark_room_{v}) -m int le 0 }}",
    ]


def backend_rules(backend: str) -> list[str]:
    v = _var(backend)
    return [
        f"    {MARKER}: remember the limit and the wait the ingress publishes, and strip them",
        f"    http-response set-var(proc.dspark_limit_{v}) res.hdr({LIMIT_HEADER}),add(0) "
        f"if {{ res.hdr({LIMIT_HEADER}) -m found }}",
        f"    http-response set-var(proc.dspark_retry_{v}) res.hdr({RETRY_HEADER}),add(0) "
        f"if {{ res.hdr({RETRY_HEADER}) -m found }}",
        f"    http-response del-header {LIMIT_HEADER}",
        f"    http-response del-header {RETRY_HEADER}",
    ]


def add_rules(config: str) -> str:
    """The config with the front-door rules for every backend the HTTP frontend routes to (idempotent)."""
    if MARKER in config:
        return config
    lines = config.split("\n")
    out: list[str] = []
    section = ""
    backends = [m.group(1) for m in re.finditer(r"^\s*use_backend (\S+) if is_\1\s*$", config, re.M)]
    if not backends:
        return _warming_rules(lines)
    inserted_frontend = False
    for line in lines:
        stripped = line.strip()
        if line and not line[0].isspace():
            section = stripped
            out.append(line)
            name = stripped.split()[1] if stripped.startswith("backend ") and len(stripped.split()) > 1 else ""
            if name in backends:
                out += backend_rules(name)
            continue
        if (section == "frontend http_frontend" and not inserted_frontend
                and stripped.startswith("use_backend ")):
            out.append(f"    acl dspark_generate path {' '.join(GENERATE_PATHS)}")
            for b in backends:
                out += frontend_rules(b)
            inserted_frontend = True
        out.append(line)
    return "\n".join(out)


def _warming_rules(lines: list[str]) -> str:
    """No application routed yet (Serve is still deploying it): the API paths answer 503 + Retry-After, as the
    ingress does while it warms up, instead of the generated config's 404 "Path not found"."""
    out: list[str] = []
    for line in lines:
        out.append(line)
        if line.strip() == "frontend http_frontend":
            out += [f"    {MARKER}: no application yet, so the API is warming up",
                    "    http-request return status 503 content-type application/json hdr Retry-After 2 "
                    f"string \"{WARMING_BODY}\" if {{ path_beg /v1/ }} or {{ path /health }}"]
    return "\n".join(out)


def patch_file(path: str) -> None:
    """Add the rules to the config at `path`, under the lock Ray takes to write it."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            with open(path) as f:
                text = f.read()
            patched = add_rules(text)
            if patched != text:
                tmp = f"{path}.dspark.tmp"
                with open(tmp, "w") as f:
                    f.write(patched)
                os.replace(tmp, path)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def main(argv: list[str]) -> None:
    """`front_door_rules.py REAL_HAPROXY [haproxy args...]`: patch the `-f` config, exec the real binary."""
    real, args = argv[1], argv[2:]
    for i, arg in enumerate(args[:-1]):
        if arg == "-f" and os.path.isfile(args[i + 1]):
            try:
                patch_file(args[i + 1])
            except OSError as exc:  # never keep HAProxy from starting: the ingress still admits
                print(f"dspark front door: rules not added ({exc})", file=sys.stderr)
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv)
