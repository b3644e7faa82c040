"""`dspark bench roofline` on one target at two commits, interleaved in one run (before, after, before, after, ...),
so that a regression is told apart from a noisy host: decode tok/s per batch size, median per commit, the after /
before ratio, and the spread of each commit's own repeats (the noise the ratio is read against). JSON last.

    python scripts/roofline_before_after.py --before 36d7cf0 --repeats 3 --batch-sizes 1,8,32

The before tree is a detached `git worktree` of `--before` (removed at the end); the after tree is this checkout.
Each run is its own process with PYTHONPATH on its tree, so each imports its own dspark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _roofline(tree: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-c", "import sys; from dspark.cli import app; sys.argv = ['dspark'] + sys.argv[1:]; app()",
           "bench", "roofline", "--target", args.target, "--dtypes", args.dtype, "--batch-sizes", args.batch_sizes,
           "--num-threads", str(args.num_threads)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _summary(runs: list[dict], dtype: str) -> dict:
    """Per batch size: decode tok/s of each repeat and their median; GEMM roofline at 1 and 32 rows likewise."""
    by_dtype = [r["by_dtype"][dtype] for r in runs]
    decode = {b: [d["decode"][b]["tok_s"] for d in by_dtype] for b in by_dtype[0]["decode"]}
    roof = {rows: [d["gemm_roofline"][rows]["gflop_s"] for d in by_dtype] for rows in ("1", "32")}
    return {"decode_tok_s": {b: {"median": statistics.median(v), "samples": v} for b, v in decode.items()},
            "gemm_gflop_s": {r: {"median": statistics.median(v), "samples": v} for r, v in roof.items()},
            "batch1_over_memory_floor": [d["batch1_over_memory_floor"] for d in by_dtype]}


def _spread(samples: list[float]) -> float:
    """(max - min) / median of one commit's repeats."""
    return (max(samples) - min(samples)) / statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="The commit measured as before.")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3, help="Runs per commit (interleaved).")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="Also write the JSON here.")
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dspark-before-") as tmp:
        before_tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before_tree), args.before],
                       check=True, capture_output=True)
        try:
            trees = {"before": before_tree, "after": ROOT}
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for _ in range(args.repeats):
                for arm, tree in trees.items():
                    runs[arm].append(_roofline(tree, args))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before_tree)], check=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    commits = {"before": args.before, "after": head}
    summary = {arm: _summary(r, args.dtype) for arm, r in runs.items()}
    verdict = {}
    for b, after in summary["after"]["decode_tok_s"].items():
        before = summary["before"]["decode_tok_s"][b]
        noise = max(_spread(before["samples"]), _spread(after["samples"]))
        ratio = after["median"] / before["median"]
        verdict[b] = {"after_over_before": round(ratio, 3), "noise": round(noise, 3),
                      "within_noise": abs(ratio - 1) <= noise}
    print(json.dumps(out := {
        "target": args.target, "dtype": args.dtype, "repeats": args.repeats, "commits": commits,
        "cpu": runs["after"][0]["cpu"], "num_threads": args.num_threads, "summary": summary,
        "decode_after_over_before": verdict, "wall_s": round(time.perf_counter() - t0, 1)}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
