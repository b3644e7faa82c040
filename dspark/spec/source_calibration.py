"""Calibrated survival for the training-free sources (the suffix index, the request's own text).

A walk tells, per proposed token k, what the source knows: its conditional frequency f_k after its
context, that context's support n_k (occurrences), the context's length m_k and the position k. The
probability that the token survives verification given that tokens 1..k-1 did, c_k, is read from a
table of binned acceptance counts fitted on held-out data (the same role STS plays for DSpark's
confidence head): per source and regime (T = 0 "greedy"; T > 0 "sampled": a deterministic draft verified as a
point mass; T > 0 "empirical": a draft drawn from the source's continuation distribution q, f_k then being
q_k's largest probability), bins over (f, n, m, k) with
back-off to coarser bins where a cell is thin (each level shrinks toward its parent by `prior_weight`
pseudo-trials). Binning is a histogram calibrator: within each cell the estimate IS the observed rate,
which is what drives the ECE of the survival products a_k = Π c_i down.

The tables fit each conditional c_k where position k was reached; the scheduler reads their product, the prefix
survival a_k = Π c_i, and errors of the conditionals that go together (a context whose walk is optimistic at
position 2 tends to be at 3 too) add up in it. So each (source, regime) also carries a scaling per position bin
k (1, 2, 3, 4+), c'_k = σ(logit(c_k) / T_k + s_k), fitted bin after bin on held-out rounds the tables were not
fitted on, to the log-loss of a_k itself (STS's sequential fit, which DSpark's confidences get).

Live use adds a recency correction: a deployment's traffic is not the held-out prompts (on the bench prompts
at batch 32 the corpus source's survival read 8.6 points above its acceptance), and the shipped counts are so
many that verified outcomes added to them move a cell slowly. So each (source, regime) also keeps a shift b_k
of its survival's log-odds per position bin k, c'_k = σ(logit(c_k) + b_k), learned online from the verdicts:
b_k += η (y_k − c'_k) for each position verified, a stochastic gradient step on the log-loss of those
parameters (calibration in the large per position, with an effective memory of about 1 / (η c(1 − c)) verdicts
of that bin). Per position, because the held-out fit can be off in opposite directions at different positions
for traffic it did not see: with one b for all positions, the served source on the eval sets (T = 0, 640
prompts a set) read 3.5 and 3.1 % ECE at positions 2 and 3 and 1.5-2.3 % at the others.

Lossless use: c_k depends on the context and on a deterministic draft (the walk has no randomness), so
a scheduler or source choice fed by it never lets a sampled token decide its own verification (the
paper's Appendix A concerns sampled drafts). For an "empirical" draft c_k is read from q_k's shape, which
depends on x_1..x_{k-1} but not on x_k: the Markov case Algorithm 1's prefix order is safe for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SOURCES = ("request", "corpus", "served")
# a source without tables of its own starts from another's (the deployment's served text reads like the corpus)
PRIOR_SOURCE = {"served": "corpus"}
REGIMES = ("greedy", "sampled", "empirical")
# a regime without data of its own reads another's: drafts drawn from q survive at least about as often as
# the deterministic draft of the same q's mode does, so the point-mass tables are a conservative start
PRIOR_REGIME = {"empirical": "sampled"}
_NUM_F, _NUM_N, _NUM_M, _NUM_K = 10, 7, 6, 4
_KEYS: dict[tuple[int, int, int, int], list[str]] = {}  # SourceTable._keys of each cell met so far (at most 1,680)
# every cell's keys in `SourceTable.freeze`'s order: (f, [(f,n, [(f,n,m, [f,n,m,k ...])])])
_FREEZE_KEYS = [(f"{f}", [(f"{f},{n}", [(f"{f},{n},{m}", [f"{f},{n},{m},{k}" for k in range(_NUM_K)])
                                        for m in range(_NUM_M)]) for n in range(_NUM_N)]) for f in range(_NUM_F)]
MAX_BIAS = 3.0  # |b| in log-odds: a shift past it would mean the tables describe nothing of this traffic


def regime_of(temperature: float, empirical: bool = False) -> str:
    """The regime of a proposal at `temperature`; `empirical`: drawn from q (only meaningful at T > 0)."""
    if temperature <= 0:
        return "greedy"
    return "empirical" if empirical else "sampled"


def feature_bins(freq: float, count: int, match: int, position: int) -> tuple[int, int, int, int]:
    """(f, n, m, k) bins: f in tenths; n = 1, 2, 3-4, 5-8, 9-16, 17-32, 33+; m = ≤1, 2, 3, 4-5, 6-8, 9+;
    k (1-based) = 1, 2, 3, 4+."""
    f = min(_NUM_F - 1, max(0, int(freq * _NUM_F)))
    # ⌈log2 count⌉ exactly: the smallest e with 2^e ≥ ⌈count⌉ (a live drafter bins every verified position)
    n = min(_NUM_N - 1, (math.ceil(count) - 1).bit_length()) if count > 1 else 0
    m = 0 if match <= 1 else 1 if match == 2 else 2 if match == 3 else 3 if match <= 5 else 4 if match <= 8 else 5
    k = min(_NUM_K - 1, max(0, position - 1))
    return f, n, m, k


@dataclass
class SourceTable:
    """Acceptance counts [successes, trials] per bin key, at four levels of detail."""

    counts: dict[str, list[float]] = field(default_factory=dict)
    prior_weight: float = 4.0
    _table: list | None = None  # flattened estimates, (f, n, m, k) row-major, built by `freeze`
    _dirty: bool = False  # counts added since `_table` was built

    @staticmethod
    def _keys(bins: tuple[int, int, int, int]) -> list[str]:
        """"", "f", "f,n", "f,n,m", "f,n,m,k" (built once per cell: a live drafter adds every verdict's trials)."""
        keys = _KEYS.get(bins)
        if keys is None:
            keys = _KEYS[bins] = [",".join(str(b) for b in bins[:i]) for i in range(5)]
        return keys

    def add(self, bins: tuple[int, int, int, int], success: bool) -> None:
        counts = self.counts
        for key in self._keys(bins):
            c = counts.get(key)
            if c is None:
                c = counts[key] = [0.0, 0.0]
            c[0] += float(success)
            c[1] += 1.0
        self._dirty = True

    def _shrunk(self, key: str, prior: float) -> float:
        """Bin `key`'s rate shrunk toward its parent's estimate `prior` by `prior_weight` pseudo-trials."""
        s, t = self.counts.get(key, (0.0, 0.0))
        return (s + self.prior_weight * prior) / (t + self.prior_weight)

    def estimate(self, bins: tuple[int, int, int, int]) -> float:
        est = 0.5
        for key in self._keys(bins):
            est = self._shrunk(key, est)
        return est

    def freeze(self) -> None:
        """Precompute every cell's estimate (lookups in the proposer are then one list index). Level by level,
        each bin shrunk toward its parent once, in `estimate`'s order of operations (the same floats): a live
        refresh re-freezes while serving, and cell by cell took ~5 ms a table."""
        shrunk = self._shrunk
        table: list[float] = []
        root = shrunk("", 0.5)
        for f_key, by_n in _FREEZE_KEYS:  # the keys' strings built once per process, not per freeze
            e_f = shrunk(f_key, root)
            for n_key, by_m in by_n:
                e_n = shrunk(n_key, e_f)
                for m_key, k_keys in by_m:
                    e_m = shrunk(m_key, e_n)
                    table += [shrunk(k_key, e_m) for k_key in k_keys]
        self._table = table
        self._dirty = False

    def lookup(self, bins: tuple[int, int, int, int], refreeze: bool = True) -> float:
        """The cell of `bins`; `refreeze=False`: as of the last `freeze` (see `SourceCalibration.cells`)."""
        if self._table is None or (refreeze and self._dirty):
            self.freeze()
        f, n, m, k = bins
        return self._table[((f * _NUM_N + n) * _NUM_M + m) * _NUM_K + k]  # type: ignore[index]

    @property
    def num_trials(self) -> int:
        return int(self.counts.get("", (0.0, 0.0))[1])


class SourceCalibration:
    """Conditional survival c_k of a source's proposal, per regime; uncalibrated: f_k itself."""

    def __init__(self, tables: dict[str, dict[str, SourceTable]] | None = None,
                 scaling: dict[tuple[str, str], list[tuple[float, float]]] | None = None) -> None:
        self.tables = tables or {}
        # (source, regime) -> (T_k, s_k) per position bin k (module doc); none: the tables' c_k as they are
        self.scaling = scaling or {}
        # (source, regime) -> live log-odds shift per position bin (module doc)
        self.bias: dict[tuple[str, str], list[float]] = {}

    def table(self, source: str, regime: str) -> SourceTable | None:
        return self.tables.get(regime, {}).get(source)

    def _resolved_key(self, source: str, regime: str) -> tuple[str, str] | None:
        """Whose table speaks for (source, regime): its own, else its prior source's, else the same two in the
        prior regime; None where none has data."""
        for reg in (regime, PRIOR_REGIME.get(regime)):
            for src in (source, PRIOR_SOURCE.get(source)):
                table = self.table(src, reg) if src and reg else None
                if table is not None and table.num_trials > 0:
                    return src, reg  # type: ignore[return-value]
        return None

    def _resolved(self, source: str, regime: str) -> SourceTable | None:
        key = self._resolved_key(source, regime)
        return self.table(*key) if key is not None else None

    def _scaling(self, source: str, regime: str) -> list[tuple[float, float]] | None:
        """The scaling fitted to the table that speaks for (source, regime) (`_resolved_key`), if any."""
        key = self._resolved_key(source, regime)
        return self.scaling.get(key) if key is not None else None

    def cells(self, source: str, regime: str, refreeze: bool = True) -> list[float] | None:
        """The table's estimates in (f, n, m, k) row-major order (the layout the native walk reads), or None
        where neither the source nor its priors have data in this regime (see `_resolved`). `refreeze=False`:
        a table frozen before keeps the estimates of its last `freeze` even if counts came in since (a live
        drafter re-reads cells whenever a shift moves, and takes new counts in at its own pace, `refreeze`)."""
        table = self._resolved(source, regime)
        if table is None:
            return None
        if table._table is None or (refreeze and table._dirty):
            table.freeze()
        return _shifted(table._table, self.bias.get((source, regime)), self._scaling(source, regime))

    def refreeze(self) -> None:
        """Every table that took counts since its last `freeze` freezes again (~2.5 ms a table)."""
        for by_source in self.tables.values():
            for table in by_source.values():
                if table._dirty:
                    table.freeze()

    def conditional(self, source: str, regime: str, freq: list[float], count: list[int],
                    match: list[int], refreeze: bool = True) -> list[float]:
        """c_k of a walk's steps, as `cells` gives them (`refreeze` as there)."""
        table = self._resolved(source, regime)
        if table is None:
            return [min(0.99, max(0.01, f)) for f in freq]
        bins = [feature_bins(f, n, m, k + 1) for k, (f, n, m) in enumerate(zip(freq, count, match))]
        return _shifted([table.lookup(b, refreeze) for b in bins], self.bias.get((source, regime)),
                        self._scaling(source, regime), [b[3] for b in bins])

    def record(self, source: str, regime: str, freq: list[float], count: list[int], match: list[int],
               num_verified: int, num_accepted: int, predicted: Sequence[float] | None = None,
               bias_rate: float = 0.0) -> None:
        """One verified proposal: position k (0-based) is a trial when it was verified and 0..k-1 were accepted;
        a success when it was accepted too. A table new to (source, regime) starts from the counts of what
        spoke for it until now (`_resolved`), then learns its own. With `predicted` (the survival c_k the
        proposal carried) and `bias_rate` η > 0, the live log-odds shift of (source, regime) learns too."""
        trials = min(num_verified, num_accepted + 1, len(freq))
        if predicted is not None and bias_rate > 0 and trials > 0:
            b = self.bias.setdefault((source, regime), [0.0] * _NUM_K)
            for k in range(trials):
                kb = min(k, _NUM_K - 1)
                b[kb] = max(-MAX_BIAS, min(MAX_BIAS, b[kb] + bias_rate * (float(k < num_accepted) - predicted[k])))
        by_source = self.tables.setdefault(regime, {})
        if source not in by_source:
            prior = self._resolved(source, regime)
            scaling = self._scaling(source, regime)  # the scaling of those counts comes along with them
            if scaling is not None:
                self.scaling.setdefault((source, regime), scaling)
            by_source[source] = SourceTable({k: list(v) for k, v in prior.counts.items()} if prior else {},
                                            prior.prior_weight if prior else 4.0)
        table = by_source[source]
        for k in range(trials):
            table.add(feature_bins(freq[k], count[k], match[k], k + 1), k < num_accepted)

    def to_dict(self) -> dict:
        out = {"format": "binned-v1", "tables": {r: {s: {"counts": t.counts, "prior_weight": t.prior_weight}
                                                     for s, t in by_source.items()}
                                                 for r, by_source in self.tables.items()}}
        if self.scaling:
            out["scaling"] = {f"{s}/{r}": [list(p) for p in params] for (s, r), params in self.scaling.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> SourceCalibration:
        if data.get("format") != "binned-v1":
            raise ValueError(f"unknown source calibration format {data.get('format')!r}")
        scaling = {}
        for key, params in (data.get("scaling") or {}).items():
            source, _, regime = key.partition("/")
            if len(params) != _NUM_K or any(len(p) != 2 or not p[0] > 0 for p in params):
                raise ValueError(f"scaling of {key}: expected {_NUM_K} pairs (T > 0, s), got {params!r}")
            scaling[(source, regime)] = [(float(t), float(b)) for t, b in params]
        return cls({r: {s: SourceTable(dict(t["counts"]), float(t["prior_weight"])) for s, t in by_source.items()}
                    for r, by_source in data["tables"].items()}, scaling)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: Path) -> SourceCalibration:
        return cls.from_dict(json.loads(path.read_text()))


def _shifted(cells: list[float], bias: Sequence[float] | None, scaling: list[tuple[float, float]] | None = None,
             position_bins: list[int] | None = None) -> list[float]:
    """σ(logit(c) / T_k + s_k + b_k) of every c (the cells themselves when there is neither a shift nor a
    scaling); c's position bin k is `position_bins`' entry, or, without it, its index modulo the number of bins
    (the (f, n, m, k) row-major layout of a whole table)."""
    if not any(bias or ()) and not scaling:
        return cells
    c = np.clip(np.asarray(cells, dtype=np.float64), 1e-6, 1 - 1e-6)
    logit = np.log(c / (1.0 - c))
    k = np.asarray(position_bins, dtype=np.int64) if position_bins is not None else np.arange(len(c)) % _NUM_K
    if scaling:
        temps, shifts = np.asarray(scaling, dtype=np.float64).T
        logit = logit / temps[k] + shifts[k]
    if bias is not None:
        logit = logit + np.asarray(bias, dtype=np.float64)[k]
    return (1.0 / (1.0 + np.exp(-logit))).tolist()


def fit_scaling(conditionals: list[list[float]], num_verified: list[int], num_accepted: list[int],
                temps: Sequence[float] = tuple(np.geomspace(0.5, 2.0, 25)),
                shifts: Sequence[float] = tuple(np.linspace(-1.0, 1.0, 41))) -> list[tuple[float, float]]:
    """(T_k, s_k) per position bin for rounds of one (source, regime): `conditionals[i]` the tables' c of round
    i's positions, verified up to num_verified[i], accepted up to num_accepted[i]. Bin after bin (1, 2, 3, 4+),
    the grid point whose prefix survival a_k has the least log-loss on the bin's verified positions, given the
    bins before it (sequential, as STS); a bin without rounds keeps (1, 0)."""
    gamma = max((len(c) for c in conditionals), default=0)
    params = [(1.0, 0.0)] * _NUM_K
    if gamma == 0:
        return params
    logit = np.zeros((len(conditionals), gamma))
    valid = np.zeros((len(conditionals), gamma), dtype=bool)
    label = np.zeros((len(conditionals), gamma))
    for i, (c, v, n) in enumerate(zip(conditionals, num_verified, num_accepted)):
        cc = np.clip(np.asarray(c, dtype=np.float64), 1e-6, 1 - 1e-6)
        logit[i, :len(cc)] = np.log(cc / (1 - cc))
        valid[i, :min(v, len(cc))] = True
        label[i, :n] = 1.0
    pos_bin = np.minimum(np.arange(gamma), _NUM_K - 1)
    grid_t, grid_s = np.meshgrid(np.asarray(temps, dtype=np.float64), np.asarray(shifts, dtype=np.float64))
    grid_t, grid_s = grid_t.ravel(), grid_s.ravel()
    log_prefix = np.zeros(len(conditionals))  # log a_{k-1} under the bins fitted so far
    for b in range(_NUM_K):
        cols = [k for k in range(gamma) if pos_bin[k] == b]
        if not cols or not valid[:, cols].any():
            break
        # every grid point at once: (G, rounds) log c'_k of each column in the bin, accumulated along the bin
        loss = np.zeros(len(grid_t))
        acc = np.broadcast_to(log_prefix, (len(grid_t), len(log_prefix))).copy()
        for k in cols:
            z = logit[:, k][None, :] / grid_t[:, None] + grid_s[:, None]
            acc += -np.logaddexp(0.0, -z)  # log σ(z)
            m = valid[:, k]
            a = np.clip(np.exp(acc[:, m]), 1e-9, 1 - 1e-9)
            y = label[m, k][None, :]
            loss += -(y * np.log(a) + (1 - y) * np.log1p(-a)).sum(axis=1)
        best = int(np.argmin(loss))
        params[b] = (float(grid_t[best]), float(grid_s[best]))
        for k in cols:
            log_prefix = log_prefix - np.logaddexp(0.0, -(logit[:, k] / params[b][0] + params[b][1]))
    return params
