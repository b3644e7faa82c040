"""`dspark suffix calibrate`: fit the suffix sources' survival on held-out self-distilled prompts.

The index is built WITHOUT the held-out records (the prompt-hash split training uses), the engine
generates their responses with the suffix drafter in explore mode (the sources alternate, so both are
verified) and a fixed block (every proposed token verified), and each verified proposal adds its
per-position outcomes to the tables of `SourceCalibration`. Prompts go in turn to the tables (half of them), to
the scaling of the prefix survival (a quarter: rounds the tables were not fitted on) and to the evaluation (a
quarter): the ECE reported is of the fitted tables and scaling on rounds neither was fitted on (a scaling is
kept only where it lowers its source's ECE on those rounds, so for a kept one that figure is slightly
optimistic).

The tables learn from every explore round; the scaling and the ECE read only the rounds where the serving rule
would have picked the source that was verified (`preferred`, replayed on every source's walk of the round). A
source wins where its survival reads high against the others', so where it wins its estimate errs high: the
winner's curse. On 960 held-out prompts at T = 0 (session 42) the served source's tables alone read ECE 7.2 %
(noise floor 4.0 %) on the rounds it would have won, over-confident; its scaling fitted on such rounds moves
every position bin down (-0.2 .. -0.7 in log-odds).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from dspark.models.drafters.suffix.drafter import SuffixDrafter
from dspark.spec.calibration import ece, ece_noise_floor
from dspark.spec.source_calibration import REGIMES, SOURCES, SourceCalibration, fit_scaling
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams


@dataclass
class RoundLog:
    """Verified proposals: (source, regime, freq, count, match, num_verified, num_accepted, alternatives), the
    last every source's deterministic walk of the round as (source, freq, count, match), in source order."""

    rows: list[tuple] = field(default_factory=list)

    def picked(self, calibration: SourceCalibration) -> RoundLog:
        """The rounds whose verified source the choice rule picks under `calibration` (`preferred`)."""
        return RoundLog([r for r in self.rows if preferred(calibration, r)])


def preferred(calibration: SourceCalibration, row: tuple) -> bool:
    """Whether the serving rule (the source with the most expected accepted tokens Σ_k Π_{i≤k} c_i, ties to the
    earlier source: `propose_batch` in suffix_kernels.c) picks the source of explore round `row` under
    `calibration`. The survival the scheduler reads is the chosen source's, on the rounds where it won: a
    source that wins where its walk's survival reads highest against the others' is judged and scaled there
    (a rarely chosen source is picked where its estimate is most optimistic, the winner's curse)."""
    source, regime, alternatives = row[0], row[1], row[7]
    best, best_expected = None, 0.0
    for src, freq, count, match in alternatives:
        expected = sum(itertools.accumulate(calibration.conditional(src, regime, freq, count, match), operator.mul))
        if best is None or expected > best_expected:
            best, best_expected = src, expected
    return best is None or best == source


def collect(engine: Engine, drafter: SuffixDrafter, prompts: list[list[int]], temperature: float,
            max_new_tokens: int, batch_size: int, seed: int, fit: SourceCalibration, scale: RoundLog,
            held: RoundLog, progress: tqdm | None = None) -> None:
    """Generate `prompts`; rounds of prompt i go into `fit` for even i, `scale` for i = 1 mod 4 and `held` for
    i = 3 mod 4. Each temperature's outputs join a served store of its own (the tenant `cal-T=<t>`): the same
    prompts at the next temperature would otherwise draft from the previous one's outputs, and the served
    source's survival be fitted on recall."""
    ids = itertools.count()
    part_of: dict[str, int] = {}  # request id -> its prompt index mod 4
    original = drafter.feedback

    def record(request_ids: list[str], num_verified: list[int], num_accepted: list[int]) -> None:
        for rid, n_ver, n_acc in zip(request_ids, num_verified, num_accepted):
            p = drafter.last.get(rid)
            if p is None or n_ver == 0:
                continue
            w = p.walk
            part = part_of.get(rid, 0)
            if part % 2 == 0:
                fit.record(p.source, p.regime, w.freq, w.count, w.match, n_ver, n_acc)
            else:
                alternatives = tuple((s, a.freq, a.count, a.match) for s, a in p.alternatives)
                (scale if part == 1 else held).rows.append((p.source, p.regime, w.freq, w.count, w.match, n_ver,
                                                            n_acc, alternatives))
        original(request_ids, num_verified, num_accepted)

    drafter.feedback = record  # type: ignore[method-assign]
    try:
        for i in range(0, len(prompts), batch_size):
            group = prompts[i:i + batch_size]
            for j in range(len(group)):
                part_of[f"cal-{temperature}-{i + j}"] = (i + j) % 4
            params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i + j,
                                     tenant=f"cal-T={temperature}") for j in range(len(group))]
            for p, sp in zip(group, params):
                engine.add_request(p, sp, request_id=f"cal-{temperature}-{next(ids)}")
            while engine.has_unfinished():
                outs = engine.step()
                if progress is not None:
                    progress.update(sum(len(o.new_token_ids) for o in outs))
    finally:
        drafter.feedback = original  # type: ignore[method-assign]


def fit_scalings(calibration: SourceCalibration, scale: RoundLog, held: RoundLog, gamma: int) -> dict:
    """The prefix-survival scaling of every (source, regime), fitted on the tables' c_k of the `scale` rounds the
    choice rule picks that source in (`preferred`, under the tables alone: the rounds whose survival the
    scheduler reads), kept only where it lowers that source's ECE on the `held` rounds it is picked in (a few
    hundred rounds of a rarely chosen source fit a scaling that reads the noise: s37, the served source's
    held-out ECE 2.8 -> 3.9 %). Returns, per "source/regime", the scaling, whether it was kept and the rounds it
    was fitted on."""
    calibration.scaling.clear()
    scale, held = scale.picked(calibration), held.picked(calibration)
    before = heldout_ece(calibration, held, gamma)
    groups: dict[tuple[str, str], list[tuple]] = {}
    for row in scale.rows:
        groups.setdefault((row[0], row[1]), []).append(row)
    out: dict = {}
    for (source, regime), rows in groups.items():
        conds = [calibration.conditional(source, regime, freq, count, match) for _, _, freq, count, match, *_ in rows]
        params = fit_scaling(conds, [r[5] for r in rows], [r[6] for r in rows])
        calibration.scaling[(source, regime)] = params
        judged = [r for r in held.rows if r[0] == source and r[1] == regime]
        with_it = heldout_ece(calibration, RoundLog(judged), gamma).get(regime, {}).get(source)
        without = before.get(regime, {}).get(source)
        kept = with_it is not None and without is not None and \
            with_it["ece_mean_over_positions"] < without["ece_mean_over_positions"]
        if not kept:
            del calibration.scaling[(source, regime)]
        out[f"{source}/{regime}"] = {"params": params, "kept": kept, "num_rounds": len(rows)}
    return out


def heldout_ece(calibration: SourceCalibration, held: RoundLog, gamma: int) -> dict:
    """Per regime and source: mean over positions of the ECE of survival a_k = Π c_i against survival,
    on rounds the tables were not fitted on; also the number of rounds."""
    out: dict = {}
    for regime in REGIMES:
        for source in SOURCES:
            rows = [r for r in held.rows if r[0] == source and r[1] == regime]
            if not rows:
                continue
            pred = torch.zeros(len(rows), gamma)
            label = torch.zeros(len(rows), gamma)
            valid = torch.zeros(len(rows), gamma, dtype=torch.bool)
            for i, (src, reg, freq, count, match, n_ver, n_acc, _) in enumerate(rows):
                cond = calibration.conditional(src, reg, freq, count, match)
                a = torch.cumprod(torch.tensor(cond[:gamma]), 0)
                pred[i, :len(a)] = a
                valid[i, :min(n_ver, len(a))] = True
                label[i, :n_acc] = 1.0
            positions = [k for k in range(gamma) if bool(valid[:, k].any())]
            per_pos = [ece(pred[valid[:, k], k], label[valid[:, k], k]) for k in positions]
            floor = [ece_noise_floor(pred[valid[:, k], k]) for k in positions]
            pooled = ece(pred[valid], label[valid])
            out.setdefault(regime, {})[source] = {
                "num_rounds": len(rows), "ece_mean_over_positions": sum(per_pos) / max(1, len(per_pos)),
                "ece_per_position": per_pos, "ece_pooled": pooled,
                # the same mean for a perfectly calibrated survival on these rounds (sampling noise alone)
                "ece_noise_floor_mean_over_positions": sum(floor) / max(1, len(floor))}
    return out
