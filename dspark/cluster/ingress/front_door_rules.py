"""HAProxy refuses a burst itself: rules added to the config Ray Serve generates, by the limit the ingress publishes.

Every response of the generate routes carries the ingress replica's admission limit (requests in flight it
admits within the SLA, all arms) and its predicted wait (`x-dspark-admit-limit`, `x-dspark-retry-after`,
admission_gate.py). HAProxy keeps the last of each in a process variable per backend and strips them from
the response; a new generate request is answered by HAProxy itself, 429 with `Retry-After` and an
OpenAI-style body (and `x-dspark-refused-by: front-door`), while the backend already holds that many
requests (the limit times the backend's usable servers; in flight is counted by a stick counter the moment
HAProxy lets a request through, and drops when it ends). Nothing Python runs for it: a burst of thousands
costs HAProxy's speed.

Past the limit, a few requests a second (`DSPARK_FRONT_DOOR_EXCESS_PER_S`, default 4, per backend) still go
through, to be refused by admission, which counts them as demand for the autoscaler. A rate, not a number
in flight: a slack of N requests in flight past the limit was refilled as fast as the ingress refused them,
so the share of a burst that reached Python grew with the ingress's speed (21 % and 88 % of the refusals in
a burst of 2,000 on an idle test cluster, session 40), where a rate bounds it by the burst's duration.

Until the first response after a start HAProxy knows no limit and forwards everything; admission in the
ingress refuses as before. The limit is never below 1 per replica, so
an idle backend always lets a request through, whose response brings the current limit.

A reload (Ray starts a new haproxy with `-sf OLD_PID` whenever its routes or replicas change: four times in
the first seconds of a test cluster, later on every scaling step) starts a process whose variables are empty.
So the wrapper asks the running process for the limit and the wait it learned (`get var` on the admin socket
Ray's config names) and writes them into the new config's global section (`set-var`): the new process refuses
by them from its first request. Without that a burst that came just after a reload was forwarded whole, before
any response could bring the limit (0 of 1,873-1,892 refusals by the door in 2 of 3 runs of the burst test,
session 44). The new process still counts in flight only what it forwarded itself: requests the old one
still serves are not counted, so for one request's time after a reload up to a limit more may reach the
ingress, which refuses them.

At a first start Serve routes the application before its ingress replica is up: the generated backend then holds
only Serve's own proxy as a `backup` server, which keeps a request until a replica comes, 20-25 s on a 2-core
machine (a new user's chat hung past curl's 20 s there, session 55) only to be answered 503 "warming up" by the
ingress. So while a routed backend has never had a replica (no `server` line but the backup, and no marker
file beside the config saying one was seen), HAProxy answers its API paths and /health 503 + Retry-After itself,
as before the routing (/health too, so that it says ready only once the API is let through). Once a replica was
seen, a backend that loses its replicas sends to Serve's proxy as Ray meant it
(a replacement replica takes the queued requests).

Ray Serve writes its HAProxy config itself (no hook), so `front_door.py` points Serve's HAProxy binary at a
small wrapper script that runs this file: it adds the rules to the config named by `-f` (in place, under
Ray's own lock file, idempotently) and then execs the real haproxy with the same arguments, so the process,
its command line and Ray's reload protocol (`-sf`, `-x`) are unchanged. Stdlib only: it runs before any
package is importable, with `python -S`.

Before the exec it also puts HAProxy first on the CPU (`raise_priority`): a session of its own (so, where the
kernel schedules by session groups, `sched_autogroup`, a group of its own) at niceness `DSPARK_HAPROXY_NICE`
(default -10). A refusal costs HAProxy ~50 µs of CPU, but in a burst it shares the cores with everything
the burst wakes (the ingress, the pools, a load generator on the same machine): measured on the 2-core
Xeon, HAProxy at niceness 0 in Ray's session group sent its first answers 30-95 ms into a burst of 1,280;
raised, it answered some bursts within a few ms and others still late (docs/results/ops/README.md).
Raising a priority needs CAP_SYS_NICE (root has it); without it HAProxy keeps the niceness it was started
with, and this says so on stderr.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import sys

MARKER = "# dspark front door"
CARRIED = f"{MARKER}: learned by the process this one replaces"
LIMIT_HEADER = "x-dspark-admit-limit"
RETRY_HEADER = "x-dspark-retry-after"
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
EXCESS_PER_S = 4  # past-the-limit requests a second let through to admission, per backend (demand it counts)
HAPROXY_NICE = -10  # the front door before every other process on the node (the request path's Python is at 0)
WARMING_BODY = ('{\\"error\\":{\\"message\\":\\"the server is starting; retry later\\",'
                '\\"type\\":\\"service_unavailable_error\\",\\"param\\":null,\\"code\\":\\"warming_up\\"}}')
BODY = ('{\\"error\\":{\\"message\\":\\"the server is at capacity; retry later\\",'
        '\\"type\\":\\"rate_limit_error\\",\\"param\\":null,\\"code\\":\\"overloaded\\"}}')


def _var(backend: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", backend)


def _table(backend: str) -> str:
    return f"dspark_inflight_{_var(backend)}"


def _excess_table(backend: str) -> str:
    return f"dspark_excess_{_var(backend)}"


def _backends(config: str) -> list[str]:
    """The backends the HTTP frontend routes to."""
    return [m.group(1) for m in re.finditer(r"^\s*use_backend (\S+) if is_\1\s*$", config, re.M)]


def _learned_names(backend: str) -> list[str]:
    return [f"proc.dspark_limit_{_var(backend)}", f"proc.dspark_retry_{_var(backend)}"]


def frontend_rules(backend: str, excess_per_s: int = EXCESS_PER_S) -> list[str]:
    v, table, excess = _var(backend), _table(backend), _excess_table(backend)
    room = f"txn.dspark_room_{v}"
    over = f"dspark_generate is_{backend} {{ var({room}) -m found }} {{ var({room}) -m int le 0 }}"
    refuse = f"{over} {{ sc1_gpc0_rate ge {excess_per_s} }}"
    return [
        f"    {MARKER}: refuse generate requests past the limit the ingress publishes ({backend})",
        # in flight: the generate requests forwarded and not yet ended, counted the moment each is let through
        # (a stick counter; the backend's connection count, be_conn, also counts idle pooled connections and
        # not those still connecting)
        f"    http-request set-var(txn.dspark_busy_{v}) int(0),table_conn_cur({table}) if dspark_generate is_{backend}",
        f"    http-request set-var(txn.dspark_room_{v}) nbsrv({backend}),mul(proc.dspark_limit_{v}),"
        f"sub(txn.dspark_busy_{v}) if dspark_generate is_{backend} {{ var(proc.dspark_limit_{v}) -m found }}",
        # past the limit: refused unless fewer than `excess_per_s` went through in the last second (a counter
        # of those let through, so a flood of refusals does not starve admission of its demand signal)
        f"    http-request track-sc1 int(0) table {excess} if {over}",
        # refused at the door: not logged (each log line is formatting and two sends, one to Serve's per-request
        # metrics socket, which a Python process parses); HAProxy's own counters still count the 429s
        f"    http-request set-log-level silent if {refuse}",
        f"    http-request return status 429 content-type application/json "
        f"hdr Retry-After \"%[var(proc.dspark_retry_{v})]\" hdr x-dspark-refused-by front-door "
        f"string \"{BODY}\" if {refuse}",
        f"    http-request sc-inc-gpc0(1) if {over}",
        f"    http-request track-sc2 int(0) table {table} if dspark_generate is_{backend}",
    ]


def table_sections(backend: str) -> list[str]:
    """Backends that only hold stick tables: the generate requests in flight to `backend`, and the rate of
    those let through past its limit."""
    return [f"backend {_table(backend)}", f"    {MARKER}: generate requests in flight to {backend}",
            "    stick-table type integer size 1 store conn_cur",
            f"backend {_excess_table(backend)}", f"    {MARKER}: requests let through past {backend}'s limit",
            "    stick-table type integer size 1 expire 10s store gpc0_rate(1s)"]


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


def _backend_section(header: str) -> str:
    """The backend a section header line names ("" for any other section)."""
    words = header.split()
    return words[1] if len(words) > 1 and words[0] == "backend" else ""


def active_servers(config: str) -> dict[str, int]:
    """Per backend section, its `server` lines that are not `backup` (Serve's replicas; its proxy is the backup)."""
    counts: dict[str, int] = {}
    name = ""
    for line in config.split("\n"):
        stripped = line.strip()
        if line and not line[0].isspace():
            name = _backend_section(stripped)
            if name:
                counts.setdefault(name, 0)
        elif name and stripped.startswith("server ") and "backup" not in stripped.split()[3:]:
            counts[name] += 1
    return counts


def _warming_return(condition: str) -> str:
    """HAProxy answering 503 warming up + Retry-After itself where `condition` holds."""
    return ("    http-request return status 503 content-type application/json hdr Retry-After 2 "
            f"string \"{WARMING_BODY}\" if {condition}")


def warming_rule(backend: str) -> list[str]:
    """A routed backend without a replica yet: its API paths and its /health answered 503 warming up by HAProxy.
    /health too: once the replica is up, Serve's proxy (the backup) answers it 200 before Ray's reload brings
    the replica into this config, and a client that waited for /health (`bench serve` does) then had its first
    chats refused by this rule (3 of 3 in one CI run, session 56)."""
    return [f"    {MARKER}: {backend} has no replica yet, so its API is warming up",
            _warming_return(f"is_{backend} {{ path_beg /v1/ }} or is_{backend} {{ path /health }}")]


def add_rules(config: str, excess_per_s: int = EXCESS_PER_S, starting: tuple[str, ...] = ()) -> str:
    """The config with the front-door rules for every backend the HTTP frontend routes to (idempotent);
    `starting`: routed backends that have never had a replica (their API answered 503, warming up)."""
    if MARKER in config:
        return config
    lines = config.split("\n")
    out: list[str] = []
    section = ""
    backends = _backends(config)
    if not backends:
        return _warming_rules(lines)
    inserted_frontend = False
    for line in lines:
        stripped = line.strip()
        if line and not line[0].isspace():
            section = stripped
            out.append(line)
            name = _backend_section(stripped)
            if name in backends:
                out += backend_rules(name)
            continue
        if (section == "frontend http_frontend" and not inserted_frontend
                and stripped.startswith("use_backend ")):
            out.append(f"    acl dspark_generate path {' '.join(GENERATE_PATHS)}")
            for b in backends:
                if b in starting:
                    out += warming_rule(b)
            for b in backends:
                out += frontend_rules(b, excess_per_s)
            inserted_frontend = True
        out.append(line)
    tail = [] if out[-1] else [out.pop()]  # the file's last newline stays last
    for b in backends:
        out += table_sections(b)
    return "\n".join(out + tail)


def _warming_rules(lines: list[str]) -> str:
    """No application routed yet (Serve is still deploying it): the API paths answer 503 + Retry-After, as the
    ingress does while it warms up, instead of the generated config's 404 "Path not found"."""
    out: list[str] = []
    for line in lines:
        out.append(line)
        if line.strip() == "frontend http_frontend":
            out += [f"    {MARKER}: no application yet, so the API is warming up",
                    _warming_return("{ path_beg /v1/ } or { path /health }")]
    return "\n".join(out)


def learned_values(config: str, timeout_s: float = 0.5) -> dict[str, int]:
    """The limit and wait the HAProxy running on `config`'s admin socket has learned, per backend (those it
    has not learned yet, or all when no process answers, are left out)."""
    found = re.search(r"^\s*stats socket (\S+)", config, re.M)
    if found is None:
        return {}
    values: dict[str, int] = {}
    for name in (n for b in _backends(config) for n in _learned_names(b)):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(found.group(1))
                s.sendall(f"get var {name}\n".encode())
                reply = b""
                while chunk := s.recv(4096):
                    reply += chunk
        except OSError:  # no process, or too slow: the new one learns from its first response
            return values
        value = re.search(rb"type=sint value=<(-?\d+)>", reply)
        if value is not None:
            values[name] = int(value.group(1))
    return values


def carry_values(config: str, values: dict[str, int]) -> str:
    """`config` with `values` set in its global section (replacing those a previous patch set)."""
    lines = [line for line in config.split("\n") if CARRIED not in line and "set-var proc.dspark_" not in line]
    if not values:
        return "\n".join(lines)
    out: list[str] = []
    for line in lines:
        out.append(line)
        if line.strip() == "global":
            out.append(f"    {CARRIED}")
            out += [f"    set-var {name} int({value})" for name, value in sorted(values.items())]
    return "\n".join(out)


def _env_int(name: str, default: int, lowest: int) -> int:
    try:
        return max(lowest, int(os.environ.get(name, str(default))))
    except ValueError:
        return default


def starting_backends(config: str, folder: str) -> tuple[str, ...]:
    """The routed backends of `config` that have never had a replica; marks in `folder` (Ray's config folder, one
    per node and cluster) those that have one now."""
    starting = []
    active = active_servers(config)
    for backend in _backends(config):
        seen = os.path.join(folder, f"dspark_replica_seen_{_var(backend)}")
        if active.get(backend, 0) > 0:
            if not os.path.exists(seen):
                open(seen, "a").close()
        elif not os.path.exists(seen):
            starting.append(backend)
    return tuple(starting)


def patch_file(path: str, excess_per_s: int = EXCESS_PER_S, learned: dict[str, int] | None = None) -> None:
    """Add the rules to the config at `path`, and what the replaced process learned, under the lock Ray takes
    to write it."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            with open(path) as f:
                text = f.read()
            patched = add_rules(text, excess_per_s, starting_backends(text, os.path.dirname(path)))
            if learned is not None:
                patched = carry_values(patched, learned)
            if patched != text:
                tmp = f"{path}.dspark.tmp"
                with open(tmp, "w") as f:
                    f.write(patched)
                os.replace(tmp, path)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def raise_priority(nice: int) -> None:
    """This process (and the haproxy it execs) first on the CPU: a session of its own, so that where the kernel
    groups processes by session for scheduling (`sched_autogroup`, on in most distributions' kernels)
    it is a group of its own, which needs little CPU and so runs as soon as it wakes, instead of one
    process in a group shared with the pools; and niceness `nice`, for its group and itself, where it may
    (CAP_SYS_NICE). Never lowers a priority."""
    try:
        os.setsid()
    except OSError:  # already a session or group leader: stays in its group
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups, or not permitted
        pass
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        print(f"dspark front door: haproxy stays at niceness {os.getpriority(os.PRIO_PROCESS, 0)}, not {nice} "
              f"({exc}); refusals under CPU load wait for their time slices", file=sys.stderr)


def main(argv: list[str]) -> None:
    """`front_door_rules.py REAL_HAPROXY [haproxy args...]`: patch the `-f` config (with what the process it
    replaces learned, on a reload: `-sf`), raise the priority, exec the real binary."""
    real, args = argv[1], argv[2:]
    excess_per_s = _env_int("DSPARK_FRONT_DOOR_EXCESS_PER_S", EXCESS_PER_S, lowest=0)
    is_reload = "-sf" in args or "-st" in args
    for i, arg in enumerate(args[:-1]):
        if arg == "-f" and os.path.isfile(args[i + 1]):
            try:
                learned = None
                if is_reload:  # asked outside Ray's lock: the running process answers at once or not at all
                    with open(args[i + 1]) as f:
                        learned = learned_values(f.read())
                patch_file(args[i + 1], excess_per_s, learned)
            except OSError as exc:  # never keep HAProxy from starting: the ingress still admits
                print(f"dspark front door: rules not added ({exc})", file=sys.stderr)
    raise_priority(_env_int("DSPARK_HAPROXY_NICE", HAPROXY_NICE, lowest=-20))
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv)
