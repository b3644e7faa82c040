"""Per arm and level of a `bench serve` JSON: throughput and median TPS/user, and their ratios to an arm's."""

import json
import sys

d = json.load(open(sys.argv[1]))
base = sys.argv[2] if len(sys.argv) > 2 else "no-spec"
for arm, a in d["arms"].items():
    for lv in a["levels"]:
        b = [x for x in d["arms"][base]["levels"] if x["concurrency"] == lv["concurrency"]][0]
        thr, tps = lv["output_throughput_tok_s"], lv["tps_user_median"]
        passes = [round(x, 1) for x in lv["pass_throughput_tok_s"]]
        print(
            f"{arm:14s} C={lv['concurrency']:3d} thr {thr:6.1f} ({thr / b['output_throughput_tok_s']:.3f}) "
            f"passes {passes} tps/user {tps:.1f} ({tps / b['tps_user_median']:.3f}) err {lv['num_errors']}"
        )
