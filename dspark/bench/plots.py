"""PNG plots for evaluation reports (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from dspark.spec.calibration import apply_temperatures  # noqa: E402

MIN_REACHED = 20  # a conditional acceptance measured on fewer rounds is noise: not drawn


def reached_counts(ds: dict) -> list[float]:
    """Rounds behind each position's conditional acceptance: the report's `reached`, or, for reports
    written before it existed, num_rounds × the product of the earlier acceptances (exact for a fixed
    block that is verified in full)."""
    if "reached" in ds:
        return [float(r) for r in ds["reached"]]
    out, n = [], float(ds["num_rounds"])
    for a in ds["conditional_acceptance"]:
        out.append(n)
        n *= a or 0.0
    return out


def pooled_acceptance(sets: list[dict]) -> tuple[list[int], list[float]]:
    """Positions k and P(accept k | 1..k-1 accepted) pooled over datasets (accepted at k / reached k),
    leaving out positions that fewer than MIN_REACHED rounds reached."""
    weighted = [(d["conditional_acceptance"], reached_counts(d)) for d in sets]
    xs: list[int] = []
    ys: list[float] = []
    for k in range(max((len(acc) for acc, _ in weighted), default=0)):
        pts = [(acc[k], n[k]) for acc, n in weighted if k < len(acc) and acc[k] is not None and n[k] > 0]
        total = sum(n for _, n in pts)
        if total >= MIN_REACHED:
            xs.append(k + 1)
            ys.append(sum(a * n for a, n in pts) / total)
    return xs, ys


def _acceptance_axis(ax) -> None:
    ax.set_xlabel("draft position k")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def plot_conditional_acceptance(report: dict, path: Path, title: str = "") -> Path:
    """One panel per temperature: P(accept k | prefix accepted) by position, a line per dataset.

    Positions reached by fewer than MIN_REACHED rounds are left out."""
    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for ax, (temp, run) in zip(axes[0], runs.items()):
        for name, ds in run["per_dataset"].items():
            ax.plot(*pooled_acceptance([ds]), marker="o", label=f"{name} (τ={ds['tau']:.2f})")
        _acceptance_axis(ax)
        ax.set_ylabel("P(accept k | 1..k-1 accepted)")
        ax.set_ylim(0, 1)
        ax.set_title(f"{title} T={temp} (points on ≥{MIN_REACHED} rounds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance_by_domain(reports: dict[str, dict], path: Path, temperature: str = "1.0") -> Path:
    """The paper's Fig. 2: P(accept k | prefix accepted) by position, one panel per domain, a line per drafter.

    `reports` maps a drafter name to its `dspark eval` JSON; a domain's curve pools its datasets
    (`pooled_acceptance`).
    """
    seen = {d["domain"] for report in reports.values() for run in report["runs"].values()
            for d in run["per_dataset"].values()}
    domains = [d for d in ("math", "code", "chat") if d in seen] + sorted(seen - {"math", "code", "chat"})
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 4), squeeze=False, sharey=True)
    for ax, domain in zip(axes[0], domains):
        for name, report in reports.items():
            run = report["runs"].get(temperature)
            if run is None:
                continue
            sets = [d for d in run["per_dataset"].values() if d["domain"] == domain]
            if not sets:
                continue
            ax.plot(*pooled_acceptance(sets), marker="o", label=name)
        ax.set_title(f"{domain} (T={temperature})")
        _acceptance_axis(ax)
    axes[0][0].set_ylabel("P(accept k | 1..k-1 accepted)")
    axes[0][0].set_ylim(0, 1)
    axes[0][-1].legend(fontsize=8, title=f"points on ≥{MIN_REACHED} rounds", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_gamma_sweep(sweep: dict, path: Path, temperature: str = "1.0") -> Path:
    """The paper's Fig. 4: τ (macro) against block size γ per drafter kind, and τ_DSpark / τ_DFlash."""
    has_ratio = bool(sweep["ratio"])
    fig, axes = plt.subplots(1, 2 if has_ratio else 1, figsize=(10 if has_ratio else 5, 4), squeeze=False)
    for kind, points in sweep["tau_macro"].items():
        gammas = sorted(points)
        axes[0][0].plot(gammas, [points[g] for g in gammas], marker="o", label=kind)
    axes[0][0].set_xlabel("block size γ")
    axes[0][0].set_ylabel(f"τ, macro average (T={temperature})")
    axes[0][0].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if has_ratio:
        gammas = sorted(sweep["ratio"])
        axes[0][1].plot(gammas, [sweep["ratio"][g] for g in gammas], marker="o", color="tab:purple")
        axes[0][1].axhline(1.0, color="grey", lw=0.8)
        axes[0][1].set_xlabel("block size γ")
        axes[0][1].set_ylabel("τ DSpark / τ DFlash")
        axes[0][1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reliability(logits: torch.Tensor, survived: torch.Tensor, valid: torch.Tensor,
                     temperatures: list[float] | None, path: Path, num_bins: int = 20) -> Path:
    """Reliability diagram of prefix survival a_k (all positions pooled), before and after STS."""
    gamma = logits.shape[1]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", label="perfect")
    for tag, temps in (("before STS", [1.0] * gamma), ("after STS", temperatures)):
        if temps is None:
            continue
        a = torch.cumprod(apply_temperatures(logits, temps), dim=1)[valid]
        y = survived[valid]
        idx = (a * num_bins).long().clamp(0, num_bins - 1)
        xs, ys = [], []
        for b in range(num_bins):
            sel = idx == b
            if int(sel.sum()) >= 5:
                xs.append(float(a[sel].mean()))
                ys.append(float(y[sel].mean()))
        ax.plot(xs, ys, marker="o", label=tag)
    ax.set_xlabel("predicted prefix survival a_k")
    ax.set_ylabel("observed survival")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _serve_levels(result: dict) -> dict[str, list[dict]]:
    """Each arm's levels (arms that failed to start have none)."""
    return {arm: a.get("levels") or [] for arm, a in result["arms"].items()}


def _arm_color(result: dict, arm: str) -> str:
    """The same color for an arm in every figure, even where another arm has nothing to draw."""
    return f"C{list(result['arms']).index(arm) % 10}"


def plot_serve_throughput_vs_tps_user(result: dict, path: Path) -> Path:
    """Output throughput vs per-user decode speed, a line per arm, points labelled by concurrency."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for arm, levels in _serve_levels(result).items():
        pts = [(lv["tps_user_median"], lv["output_throughput_tok_s"], lv["concurrency"]) for lv in levels
               if lv.get("tps_user_median") is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm, color=_arm_color(result, arm))
        for x, y, c in pts:
            ax.annotate(f"C={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("TPS/user (tokens/s per request, median)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title(f"throughput vs TPS/user ({result.get('max_tokens', '?')} output tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_serve_verify_len(result: dict, path: Path) -> Path:
    """Mean verification length per request and step vs concurrency (log2 axis), a line per spec arm."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    levels_seen: set[int] = set()
    for arm, levels in _serve_levels(result).items():
        if (result["arms"][arm].get("config") or {}).get("drafter") == "none":
            continue  # nothing to verify; a spec arm at 0 (draft gate closed) is drawn
        pts = [(lv["concurrency"], lv["mean_verify_len"]) for lv in levels if lv.get("mean_verify_len") is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm, color=_arm_color(result, arm))
            levels_seen.update(p[0] for p in pts)
    ax.set_xscale("log", base=2)
    if levels_seen:
        ax.set_xticks(sorted(levels_seen), [str(c) for c in sorted(levels_seen)])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("mean verification length (draft tokens / request / step)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_worker_timeline(stats: dict, path: Path, window_s: float = 3.0) -> Path | None:
    """Per-step spans of every verify worker (one lane per micro-batch) and its draft worker, over the last
    `window_s` seconds of `/v1/dspark/stats`: overlap shows as draft bars under verify bars of the other half."""
    lanes: list[tuple[str, list[tuple[float, float]], str]] = []
    for wid, w in sorted(stats.get("workers", {}).items()):
        steps = [t for t in w.get("timeline", []) if "micro_batch" in t]  # verify workers' step spans
        for g in sorted({t["micro_batch"] for t in steps}):
            spans = [(t["start_s"], t["end_s"]) for t in steps if t["micro_batch"] == g]
            lanes.append((f"{wid} verify mb{g}", spans, "tab:blue" if g == 0 else "tab:cyan"))
        if w.get("draft_timeline"):
            lanes.append((f"{wid} ← draft", [(t["start_s"], t["end_s"]) for t in w["draft_timeline"]], "tab:orange"))
    ends = [e for _, spans, _ in lanes for _, e in spans]
    if not ends:
        return None
    t_end = max(ends)
    t0 = t_end - window_s
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(lanes) + 1.2))
    for i, (_, spans, color) in enumerate(lanes):
        bars = [(s - t0, e - s) for s, e in spans if e >= t0]
        ax.broken_barh(bars, (i - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(lanes)), [name for name, _, _ in lanes], fontsize=7)
    ax.set_xlabel(f"seconds (last {window_s:.1f} s of the run)")
    ax.set_title("worker timeline: verify micro-batches and drafting")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_roofline(res: dict, path: Path) -> Path:
    """Achieved decode GFLOP/s against the GEMM roofline at the same row count, per dtype."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (dtype, body), color in zip(res["by_dtype"].items(), ("tab:blue", "tab:orange", "tab:green")):
        roof = body["gemm_roofline"]
        rows = sorted(int(r) for r in roof)
        ax.plot(rows, [roof[r]["gflop_s"] if r in roof else roof[str(r)]["gflop_s"] for r in rows], "--",
                color=color, label=f"{dtype} GEMM roofline")
        dec = body["decode"]
        bs = sorted(int(b) for b in dec)
        ax.plot(bs, [(dec[b] if b in dec else dec[str(b)])["achieved_gflop_s"] for b in bs], "o-", color=color,
                label=f"{dtype} decode achieved")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows per GEMM = sequences decoded per step")
    ax.set_ylabel("GFLOP/s (model GEMM FLOPs)")
    cpu = res.get("cpu", {})
    ax.set_title(f"{cpu.get('model', '')} [{' '.join(cpu.get('flags', []))}]", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, dpi=120)


def plot_autoscale(results: dict[str, dict], sla_ttft_s: float, path: Path) -> Path:
    """Per trace: load and queue, replicas of each pool, TTFT p50 against the SLA (violations shaded)."""
    fig, axes = plt.subplots(3, len(results), figsize=(4.2 * len(results), 7.5), sharex="col", squeeze=False)
    for col, (name, res) in enumerate(results.items()):
        tl = res["timeline"]
        t = [p["t_s"] for p in tl]
        ax = axes[0][col]
        ax.plot(t, [p["rate"] for p in tl], color="tab:gray", label="arrivals/s")
        ax.plot(t, [p["queue"] for p in tl], color="tab:red", label="queued")
        ax.set_title(f"{name}: {res['verify_replica_minutes']} / {res['draft_replica_minutes']} replica-min, "
                     f"SLA {100 * res['sla_violation_fraction']:.0f} %", fontsize=8)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        ax.step(t, [p["verify_replicas"] for p in tl], where="post", label="verify running")
        ax.step(t, [p["verify_replicas"] + p["verify_pending"] for p in tl], where="post", ls=":",
                label="verify asked")
        ax.step(t, [p["draft_replicas"] for p in tl], where="post", label="draft running")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
        ax = axes[2][col]
        ax.plot(t, [p["ttft_p50_s"] for p in tl], label="TTFT p50 (s)")
        ax.axhline(sla_ttft_s, color="tab:red", ls="--", lw=0.8, label="SLA")
        for p in tl:
            if p["sla_violated"]:
                ax.axvspan(p["t_s"] - 1, p["t_s"], color="tab:red", alpha=0.08, lw=0)
        ax.set_xlabel("time (s)")
        ax.legend(fontsize=7)
    return _save(fig, path, dpi=110)


def _save(fig: plt.Figure, path: Path, dpi: int) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
