"""`dspark train-curve`: a training run's learning curve from its resumable state (no model is run).

Per logged step the trainer keeps the loss and, per block position k, the mean soft acceptance c*_k =
Σ_v min(p_t, p_d) on the training text (the target's own samples, so conditional on the true prefix). The
expected tokens per round of a γ-block under those rates is τ ≈ 1 + Σ_k Π_{i≤k} c*_i (T = 1 acceptance); it
is an estimate from training batches, not a decoding measurement (`dspark eval` is). Smoothed over a window
of steps and plotted against steps and against training tokens seen (steps × blocks per step × γ).

A run that continues another (`model.init_checkpoint`) is drawn after it (`continue_curve`), and the forecast
fits τ against log(tokens seen) over the later half of the points to say how many tokens a target τ would
need if the trend held: a straight line on the log axis, which the curves so far follow.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def tau_estimate(acceptance: list[float]) -> float:
    tau, survive = 1.0, 1.0
    for c in acceptance:
        survive *= c
        tau += survive
    return tau


def learning_curve(state_path: Path, window: int = 50) -> dict:
    state = torch.load(state_path, weights_only=False, map_location="cpu")
    history = state["history"]
    cfg = json.loads(state.get("config", "{}"))
    blocks = int(cfg.get("batch_size", 8)) * int(cfg.get("num_anchors", 16))
    rows = []
    for i in range(window, len(history) + 1, max(1, window // 2)):
        chunk = history[i - window:i]
        gamma = len(chunk[0]["acceptance"])
        acc = [sum(r["acceptance"][k] for r in chunk) / len(chunk) for k in range(gamma)]
        rows.append({"step": chunk[-1]["step"], "loss": sum(r["loss"] for r in chunk) / len(chunk),
                     "tau_est_T1": round(tau_estimate(acc), 4), "acceptance": [round(a, 4) for a in acc],
                     "train_tokens": chunk[-1]["step"] * blocks * gamma})
    return {"num_steps": len(history), "blocks_per_step": blocks, "window": window, "points": rows}


def continue_curve(curve: dict, previous: dict) -> dict:
    """`curve` of a run started from `previous`'s final weights, its steps and tokens counted on from there."""
    last = previous["points"][-1]
    points = [{**p, "step": p["step"] + last["step"], "train_tokens": p["train_tokens"] + last["train_tokens"]}
              for p in curve["points"]]
    return {**curve, "points": points, "previous": previous["points"],
            "continues_from": {"step": last["step"], "train_tokens": last["train_tokens"]}}


def forecast(points: list[dict], targets: tuple[float, ...] = (2.0, 2.5, 3.0)) -> dict:
    """Least-squares τ = a + b·log2(tokens) over the later half of `points` (by tokens): b is τ per doubling of
    tokens seen; for each target τ the tokens it would take on that line (None when τ does not rise)."""
    pts = sorted(points, key=lambda p: p["train_tokens"])
    pts = pts[len(pts) // 2:]
    if len(pts) < 2:
        raise ValueError("a forecast needs at least 4 curve points")
    xs = [math.log2(p["train_tokens"]) for p in pts]
    ys = [p["tau_est_T1"] for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    needed = {f"{t:g}": (round(2 ** ((t - intercept) / slope)) if slope > 0 else None) for t in targets}
    return {"tau_per_doubling": round(slope, 4), "tau_at_1_token": round(intercept, 4),
            "fit_from_tokens": pts[0]["train_tokens"], "fit_to_tokens": pts[-1]["train_tokens"],
            "tokens_for_tau": needed}


def plot_curve(curve: dict, path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = curve["points"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot([p["step"] for p in pts], [p["tau_est_T1"] for p in pts], color="C0")
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("τ estimate (T=1, training batches)")
    ax2 = axes[0].twinx()
    ax2.plot([p["step"] for p in pts], [p["loss"] for p in pts], color="C3", alpha=0.5)
    ax2.set_ylabel("loss", color="C3")
    axes[1].plot([p["train_tokens"] / 1e6 for p in pts], [p["tau_est_T1"] for p in pts], color="C0",
                 label="this run" if curve.get("previous") else None)
    if curve.get("previous"):  # the run this one continues, and where it handed over
        prev = curve["previous"]
        for ax, key, scale in ((axes[0], "step", 1), (axes[1], "train_tokens", 1e6)):
            ax.plot([p[key] / scale for p in prev], [p["tau_est_T1"] for p in prev], color="0.55",
                    label="the run it continues" if ax is axes[1] else None)
            ax.axvline(curve["continues_from"][key] / scale, color="0.75", lw=0.8, ls=":")
    fc = curve.get("forecast")
    if fc and fc["tau_per_doubling"] > 0:  # the fitted line, drawn out to the highest target it reaches
        far = max(v for v in fc["tokens_for_tau"].values() if v is not None)
        xs = [fc["fit_from_tokens"], far]
        axes[1].plot([x / 1e6 for x in xs], [fc["tau_at_1_token"] + fc["tau_per_doubling"] * math.log2(x) for x in xs],
                     color="C2", ls="--", label=f"fit: +{fc['tau_per_doubling']:.2f} τ per doubling")
    if curve.get("previous") or fc:
        axes[1].legend(fontsize=8, loc="upper left")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("training block tokens seen (M, log)")
    axes[1].set_ylabel("τ estimate (T=1)")
    fig.suptitle(title or "drafter learning curve")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
