"""The pools' niceness covers every thread of their process, including those Ray started before the
constructor ran, and threads started afterwards inherit it. Run in a child process: renicing the test
process itself would slow the rest of the suite."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, os, threading
from dspark.config.cpu_priority import renice_process

def nice_of(tid):
    return os.getpriority(os.PRIO_PROCESS, tid)

started, stop = threading.Event(), threading.Event()
early = {}
def early_thread():
    early["tid"] = threading.get_native_id()
    started.set()
    stop.wait()
t = threading.Thread(target=early_thread); t.start(); started.wait()
before = {"main": nice_of(threading.get_native_id()), "early": nice_of(early["tid"])}
renice_process(7)
after = {"main": nice_of(threading.get_native_id()), "early": nice_of(early["tid"])}
late = {}
def late_thread():
    late["nice"] = nice_of(threading.get_native_id())
t2 = threading.Thread(target=late_thread); t2.start(); t2.join()
renice_process(30)
capped = nice_of(threading.get_native_id())
stop.set(); t.join()
print(json.dumps({"before": before, "after": after, "late": late["nice"], "capped": capped}))
"""


def test_renice_process_lowers_every_thread_and_threads_started_later_inherit() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    base = got["before"]["main"]
    assert got["before"]["early"] == base
    assert got["after"] == {"main": min(19, base + 7), "early": min(19, base + 7)}
    assert got["late"] == min(19, base + 7)
    assert got["capped"] == 19
