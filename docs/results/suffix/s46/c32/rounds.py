"""Per drafted / plain round at batch >= 30 in a `bench serve` JSON: wall time, forward, draft wait, tokens out."""

import json
import statistics as st
import sys

d = json.load(open(sys.argv[1]))
acc_by_arm = {}
for arm, a in d["arms"].items():
    for lv in a["levels"]:
        if lv["concurrency"] != 32 or not lv.get("server_stats"):
            continue
        acc = lv.get("acceptance_rate") or 0
        for w, ws in lv["server_stats"]["workers"].items():
            tl = ws.get("timeline", [])
            if not tl or "num_tokens" not in tl[0]:
                continue
            rows = []
            for a_, b in zip(tl, tl[1:]):
                if a_["num_requests"] < 30:
                    continue
                wall = (b["start_s"] - a_["start_s"]) * 1e3
                rows.append(
                    (
                        a_["num_verified"] > 0,
                        wall,
                        a_["num_requests"] + acc * a_["num_verified"],
                        a_["verify_ms"],
                        a_["draft_wait_ms"],
                        a_["num_tokens"],
                    )
                )
            for kind in (False, True):
                r = [x for x in rows if x[0] == kind]
                if not r:
                    continue
                W = sum(x[1] for x in r)
                T = sum(x[2] for x in r)
                print(
                    arm,
                    w,
                    "drafted" if kind else "plain",
                    len(r),
                    "wall/round %.1f" % (W / len(r)),
                    f"verify {st.mean(x[3] for x in r):.1f}",
                    f"wait {st.mean(x[4] for x in r):.1f}",
                    f"fwd tok {st.mean(x[5] for x in r):.1f}",
                    "est tok/round %.1f" % (T / len(r)),
                    "tok/ms %.3f" % (T / W),
                )
