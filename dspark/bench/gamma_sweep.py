"""The γ sweep (paper Fig. 4): τ of each drafter kind against its block size, from `dspark eval` reports."""

from __future__ import annotations


def gamma_sweep(reports: dict[str, dict], temperature: str = "1.0") -> dict:
    """{"tau_macro": {kind: {γ: τ}}, "tau_by_domain": {kind: {γ: {domain: τ}}}, "ratio": {γ: τ_dspark / τ_dflash}}.

    `reports` maps a run label to its `dspark eval` JSON (which records its drafter `kind` and `gamma`); each
    (kind, γ) must come from one report, and each report must hold a run at `temperature`.
    """
    tau: dict[str, dict[int, float]] = {}
    by_domain: dict[str, dict[int, dict[str, float]]] = {}
    for label, report in reports.items():
        kind, gamma = str(report.get("kind", report["drafter"])), int(report["gamma"])
        run = report["runs"].get(temperature)
        if run is None:
            raise ValueError(f"{label}: no run at T={temperature} (has {sorted(report['runs'])})")
        if gamma in tau.get(kind, {}):
            raise ValueError(f"{label}: a second {kind} report at γ={gamma}; give one report per drafter and γ")
        tau.setdefault(kind, {})[gamma] = float(run["tau_macro"])
        by_domain.setdefault(kind, {})[gamma] = dict(run["tau_by_domain"])
    ratio = {}
    if "dspark" in tau and "dflash" in tau:
        ratio = {g: tau["dspark"][g] / tau["dflash"][g] for g in sorted(set(tau["dspark"]) & set(tau["dflash"]))}
    return {"tau_macro": {k: dict(sorted(v.items())) for k, v in tau.items()},
            "tau_by_domain": {k: dict(sorted(v.items())) for k, v in by_domain.items()}, "ratio": ratio}
