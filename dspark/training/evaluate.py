"""`dspark eval`: offline drafter evaluation the paper's way (fixed block, no scheduler).

Per dataset and temperature: τ (tokens per round, bonus included), the position-wise conditional
acceptance P(accept k | 1..k-1 accepted), and calibration of the prefix-survival estimates a_k = Π c_i
against whether the prefix really survived: per-position ECE (20 bins), AUC and Brier, before and after
Sequential Temperature Scaling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from dspark.config.engine import EngineConfig
from dspark.models.drafters.base import Drafter
from dspark.models.target.loader import TargetModel
from dspark.prompts.eval_sets import DOMAINS, chat_prompt_ids, load_turns
from dspark.spec.calibration import apply_temperatures, auc, brier, ece, ece_noise_floor
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams


@dataclass
class Rounds:
    """Every verification round of a run: ℓ verified, n accepted, the drafter's confidences."""

    num_verified: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # which source drafted each round ("" where not said)

    def extend(self, other: Rounds) -> None:
        self.num_verified += other.num_verified
        self.num_accepted += other.num_accepted
        self.confidences += other.confidences
        self.sources += other.sources

    def of_source(self, source: str) -> Rounds:
        keep = [i for i, s in enumerate(self.sources) if s == source]
        return Rounds([self.num_verified[i] for i in keep], [self.num_accepted[i] for i in keep],
                      [self.confidences[i] for i in keep], [source] * len(keep))

    @property
    def tau(self) -> float:
        return (sum(self.num_accepted) + len(self.num_accepted)) / max(1, len(self.num_accepted))

    def _reached(self, k: int) -> list[int]:
        """Accepted counts of the rounds that verified position k with positions 1..k-1 accepted."""
        return [n for v, n in zip(self.num_verified, self.num_accepted) if v >= k and n >= k - 1]

    def conditional_acceptance(self, gamma: int) -> list[float | None]:
        out: list[float | None] = []
        for k in range(1, gamma + 1):
            reached = self._reached(k)
            out.append(sum(n >= k for n in reached) / len(reached) if reached else None)
        return out

    def reached(self, gamma: int) -> list[int]:
        """How many rounds each conditional acceptance rests on (its denominator), by position."""
        return [len(self._reached(k)) for k in range(1, gamma + 1)]

    def calibration_arrays(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, survived, is_valid), each (rounds, γ), for rounds that carried confidences."""
        rows = [(c, v, n) for c, v, n in zip(self.confidences, self.num_verified, self.num_accepted) if c]
        logits = torch.zeros(len(rows), gamma)
        survived = torch.zeros(len(rows), gamma)
        valid = torch.zeros(len(rows), gamma, dtype=torch.bool)
        for i, (c, v, n) in enumerate(rows):
            cc = torch.tensor(c[:gamma]).clamp(1e-6, 1 - 1e-6)
            logits[i, :len(cc)] = torch.log(cc) - torch.log1p(-cc)
            valid[i, :min(v, len(cc))] = True
            survived[i, :n] = 1.0
        return logits, survived, valid


def run_rounds(engine: Engine, prompts: list[list[int]], temperature: float, max_new_tokens: int,
               seed: int, batch_size: int, tenant: str = "") -> Rounds:
    """Generate `prompts`, `batch_size` at a time, and keep every verification round. `tenant`: whose served
    text the outputs join and draft from (the suffix proposer's served source): a run that decodes the same
    prompts again (another temperature) gives each pass its own, or its drafts recall the earlier outputs."""
    rounds = Rounds()
    for i in range(0, len(prompts), batch_size):
        engine.stats.clear()
        group = prompts[i:i + batch_size]
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i + j,
                                 tenant=tenant) for j in range(len(group))]
        engine.generate(group, params)
        for s in engine.stats:
            for r, (v, n) in enumerate(zip(s.lengths, s.num_accepted)):
                rounds.num_verified.append(v)
                rounds.num_accepted.append(n)
                rounds.confidences.append(s.confidences[r] if s.confidences else [])
                rounds.sources.append(s.sources[r] if s.sources else "")
    return rounds


def calibration_report(rounds: Rounds, gamma: int, temperatures: list[float] | None) -> dict:
    logits, survived, valid = rounds.calibration_arrays(gamma)
    if logits.shape[0] == 0:
        return {}
    out: dict = {}
    for tag, temps in (("before", [1.0] * gamma), ("after", temperatures)):
        if temps is None:
            continue
        a = torch.cumprod(apply_temperatures(logits, temps), dim=1)  # prefix survival a_k
        out[f"ece_{tag}"] = [ece(a[valid[:, k], k], survived[valid[:, k], k]) for k in range(gamma)]
        out[f"ece_{tag}_mean"] = sum(out[f"ece_{tag}"]) / gamma
        # what a perfectly calibrated a_k would show on these rounds (calibration.ece_noise_floor)
        out[f"ece_{tag}_noise_floor_mean"] = sum(ece_noise_floor(a[valid[:, k], k]) for k in range(gamma)) / gamma
        out[f"auc_{tag}"] = auc(a[valid], survived[valid])
        out[f"brier_{tag}"] = brier(a[valid], survived[valid])
        # > 0: the survival promised more than was accepted (over-confident), < 0: under-confident
        out[f"bias_{tag}"] = float(a[valid].mean() - survived[valid].float().mean()) if bool(valid.any()) else 0.0
    return out


def evaluate(target: TargetModel, drafter: Drafter, datasets: list[str], temperatures: list[float],
             num_prompts: int, max_new_tokens: int, gamma: int, batch_size: int = 8, seed: int = 0,
             sts_temperatures: list[float] | None = None) -> dict:
    cfg = EngineConfig(target=target.name, drafter="custom", scheduler="fixed", scheduler_kwargs={"k": gamma},
                       num_draft_tokens=gamma, max_num_seqs=batch_size, max_model_len=2048)
    engine = Engine(cfg, target=target, drafter=drafter)
    report: dict = {"gamma": gamma, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "runs": {}}
    all_rounds: dict[float, Rounds] = {}
    if hasattr(drafter, "reset_stats"):
        drafter.reset_stats()
    for temp in temperatures:
        per_ds: dict = {}
        pooled = Rounds()
        for ds in tqdm(datasets, desc=f"eval T={temp}"):
            prompts = [chat_prompt_ids(target.tokenizer, t) for t in load_turns(ds, num_prompts)]
            prompts = [p for p in prompts if len(p) + max_new_tokens + gamma + 2 <= 2048]
            r = run_rounds(engine, prompts, temp, max_new_tokens, seed, batch_size, tenant=f"eval-T={temp}")
            pooled.extend(r)
            name = ds.rsplit("/", 1)[-1].removesuffix(".jsonl")
            per_ds[name] = {"tau": r.tau, "domain": DOMAINS.get(name, "custom"), "num_rounds": len(r.num_accepted),
                            "conditional_acceptance": r.conditional_acceptance(gamma), "reached": r.reached(gamma)}
        domains: dict[str, list[float]] = {}
        for v in per_ds.values():
            domains.setdefault(v["domain"], []).append(v["tau"])
        report["runs"][str(temp)] = {
            "tau": {k: v["tau"] for k, v in per_ds.items()},
            "tau_macro": sum(v["tau"] for v in per_ds.values()) / len(per_ds),
            "tau_by_domain": {d: sum(t) / len(t) for d, t in domains.items()},
            "conditional_acceptance": pooled.conditional_acceptance(gamma),
            "reached": pooled.reached(gamma),
            "per_dataset": per_ds,
            "calibration": calibration_report(pooled, gamma, sts_temperatures),
        }
        named = sorted({s for s in pooled.sources if s})
        if named:  # multi-source drafters: each source's survival judged on its own rounds
            report["runs"][str(temp)]["calibration_by_source"] = {
                s: {"num_rounds": len(sub.num_accepted), **calibration_report(sub, gamma, None)}
                for s in named if (sub := pooled.of_source(s)).num_accepted}
        if hasattr(drafter, "source_stats"):  # the hybrid and suffix drafters: which source drafted what
            report["runs"][str(temp)]["sources"] = drafter.source_stats()
            drafter.reset_stats()
        all_rounds[temp] = pooled
    report["_rounds"] = all_rounds
    return report
