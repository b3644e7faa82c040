"""`dspark train-curve`: a training run's learning curve from its resumable state (no model is run).

Per logged step the trainer keeps the loss and, per block position k, the mean soft acceptance c*_k =
Σ_v min(p_t, p_d) on the training text (the target's own samples, so conditional on the true prefix). The
expected tokens per round of a γ-block under those rates is τ ≈ 1 + Σ_k Π_{i≤k} c*_i (T = 1 acceptance); it
is an estimate from training batches, not a decoding measurement (`dspark eval` is). Smoothed over a window
of steps and plotted against steps and against training tokens seen (steps × blocks per step × γ).
"""

from __future__ import annotations

import json
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
    axes[1].plot([p["train_tokens"] / 1e6 for p in pts], [p["tau_est_T1"] for p in pts], color="C0")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("training block tokens seen (M, log)")
    axes[1].set_ylabel("τ estimate (T=1)")
    fig.suptitle(title or "drafter learning curve")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
