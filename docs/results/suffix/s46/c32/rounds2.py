"""After each round at batch >= 30: time inside the round beside forward and draft wait, and the gap to the next."""

import json
import statistics as st
import sys

d = json.load(open(sys.argv[1]))
for arm, a in d["arms"].items():
    for lv in a["levels"]:
        if lv["concurrency"] != 32 or not lv.get("server_stats"):
            continue
        for _w, ws in lv["server_stats"]["workers"].items():
            tl = ws.get("timeline", [])
            if not tl or "num_tokens" not in tl[0]:
                continue
            for kind in (False, True):
                r = [
                    (a_, b)
                    for a_, b in zip(tl, tl[1:])
                    if a_["num_requests"] >= 30 and (a_["num_verified"] > 0) == kind
                ]
                if not r:
                    continue
                inside = st.mean(
                    (a_["end_s"] - a_["start_s"]) * 1e3 - a_["verify_ms"] - a_["draft_wait_ms"] for a_, b in r
                )
                gap = st.mean((b["start_s"] - a_["end_s"]) * 1e3 for a_, b in r)
                print(
                    arm,
                    "drafted" if kind else "plain",
                    len(r),
                    f"inside-other {inside:.2f}",
                    f"gap {gap:.2f}",
                    "median gap {:.2f}".format(st.median((b["start_s"] - a_["end_s"]) * 1e3 for a_, b in r)),
                )
