"""SuffixDrafter: training-free drafts from the target's own text, with calibrated survival per source.

Two sources propose for every request and step, at almost no cost (C walks, `suffix_kernels.c`):
- "request": the request's own prompt and output so far (prompt lookup, with frequencies);
- "corpus": a global suffix array over the target's self-distilled responses (`suffix/index.py`).
Each proposal's per-position survival c_k comes from `SourceCalibration` (fitted on held-out data by
`dspark suffix calibrate`), and the request gets the proposal with the larger expected number of
accepted tokens Σ_k Π_{i≤k} c_i. The drafts, the survival and so the choice are deterministic functions
of the request's tokens: verifying them as point masses (accept x with p(x), else resample from the
residual) is lossless at any temperature, and the prefix scheduler may read the confidences freely.

At T > 0 (`empirical_q`, on by default) the chosen source then DRAWS its draft from its empirical
continuation distribution q (a context's most frequent continuations, `WalkParams.max_q` of them) instead of
walking the most frequent one, and the draft carries q, so verification accepts with min(1, p/q) and
resamples max(0, p − q): where q is close to the target's p, a draft survives with Σ min(p, q) rather than
p(mode). Lossless: the source is chosen from the deterministic walks (the context alone), before anything
is drawn; each step's emission and survival c_k are read from q_k's shape (its largest probability, support,
context length, position), which depends on the tokens drawn before k but not on x_k — the Markov case the
prefix scheduler's order is safe for (schedulers.py); and min(1, p/q) with the residual is the standard
lossless rule for a draft drawn from q. `tests/test_suffix_sampled.py` checks the output distribution.

Config lives in a checkpoint-like folder (`checkpoints/suffix-smollm2/config.json`): which corpus
folders to index, the walk parameters, and `calibration.json`.
"""

from __future__ import annotations

import itertools
import json
import logging
import operator
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dspark.models.drafters.base import DraftOutput, DraftRequest, SparseQ
from dspark.models.drafters.suffix.corpus import corpus_paths, read_responses
from dspark.models.drafters.suffix.index import (
    BatchWalks,
    RequestText,
    SampledWalks,
    SuffixIndex,
    Walk,
    WalkParams,
    propose_batch,
    sample_batch,
)
from dspark.models.drafters.suffix.served import ServedConfig, ServedText
from dspark.spec.source_calibration import SOURCES, SourceCalibration, regime_of

log = logging.getLogger(__name__)

_SOURCE_NAMES = ("request", "corpus", "served")  # the native batch's source order
DEFAULT_SUFFIX_DIR = Path(__file__).resolve().parents[4] / "checkpoints" / "suffix-smollm2"


@dataclass(slots=True)  # slots: one per request a round
class Proposal:
    """What one source proposed for one request at one step (kept for calibration and metrics)."""

    source: str
    walk: Walk
    conditional: list[float]
    temperature: float = 0.0
    regime: str = "greedy"  # the calibration regime its survival was read from and its outcome feeds
    # explore mode (calibration runs) only: every source's deterministic walk of the round, in source order, the
    # inputs of the choice rule; the calibration replays the rule on them (suffix_calibrate.preferred)
    alternatives: tuple[tuple[str, Walk], ...] = ()

    @property
    def expected_tokens(self) -> float:
        """Σ_k Π_{i≤k} c_i: the accepted tokens this proposal promises (suffix_kernels.c computes the same)."""
        return sum(itertools.accumulate(self.conditional, operator.mul))


@dataclass
class SourceStats:
    """Per source: proposals made, chosen, tokens verified and accepted, accepted by position."""

    num_proposals: int = 0
    num_chosen: int = 0
    num_verified: int = 0
    num_accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * 16)


@dataclass
class SuffixConfig:
    corpus_dirs: list[str] = field(default_factory=lambda: ["data/distill/smollm2", "data/distill/smollm2-more"])
    corpus_max_tokens: int | None = None  # index only the first N tokens (the corpus-size curve)
    heldout_fraction: float = 0.0  # leave the calibration split out of the index (calibration runs)
    walk: WalkParams = field(default_factory=WalkParams)
    sources: tuple[str, ...] = SOURCES
    empirical_q: bool = True  # T > 0: draw the draft from the source's continuation distribution q (see above)
    # live calibration: verified proposals add to the shipped counts, so survival follows the deployment's
    # own traffic (the tables depend on past rounds only: lossless); cells are re-read every N outcomes
    live_calibration: bool = True
    live_refresh_every: int = 2048
    # and each source's survival is shifted in log-odds toward its recent acceptance, per position bin
    # (source_calibration.py): η of that online step (0: off); the native walk re-reads a source's cells once
    # a bin's shift moved by live_bias_refresh
    live_bias_rate: float = 0.005
    live_bias_refresh: float = 0.02
    # the outputs this deployment serves, indexed per tenant (suffix/served.py); share_served: one store for
    # every tenant (only where tenants may learn from each other's text: acceptance timing reveals it)
    served: ServedConfig = field(default_factory=ServedConfig)
    share_served: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> SuffixConfig:
        data = dict(data)
        walk = WalkParams(**data.pop("walk", {}))
        served = ServedConfig(**data.pop("served", {}))
        sources = tuple(data.pop("sources", SOURCES))
        return cls(walk=walk, served=served, sources=sources, **data)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = list(self.sources)
        return d


class SuffixDrafter:
    """Proposes the better of the request's own text and the global index (a `Drafter`)."""

    name = "suffix"

    def __init__(self, index: SuffixIndex | None, calibration: SourceCalibration | None = None,
                 config: SuffixConfig | None = None, explore: bool = False) -> None:
        self.index = index
        self.calibration = calibration or SourceCalibration()
        self.config = config or SuffixConfig()
        self.explore = explore  # calibration runs: alternate the sources so both get verified
        self._texts: dict[str, RequestText] = {}
        # (source, regime) -> (cells as float32, their address, the live shift they were read with)
        self._tables: dict[tuple[str, str], tuple[np.ndarray | None, int, float]] = {}
        self._batch: BatchWalks | None = None
        self._sampled: SampledWalks | None = None
        self._rngs: dict[str, np.random.Generator] = {}  # request id -> the draws of its sampled drafts
        self._num_live = 0  # outcomes recorded since the cells were last re-read
        self.served = ServedText(self.config.served) if "served" in self.config.sources and \
            self.config.served.is_enabled else None
        self._tenants: dict[str, str] = {}  # request id -> whose served store its text joins
        self._work = np.zeros(max(1, self.config.walk.max_occurrences), dtype=np.int64)
        self._num_rounds = 0
        self.last: dict[str, Proposal] = {}  # request id -> the chosen proposal of the latest round
        self.stats = {s: SourceStats() for s in self.config.sources}
        self.propose_ms = 0.0  # the latest round's cost

    @classmethod
    def from_pretrained(cls, path: str | Path = DEFAULT_SUFFIX_DIR, **overrides: object) -> SuffixDrafter:
        """Build from a suffix folder: config.json (+ calibration.json); `overrides` replace config keys."""
        path = Path(path)
        data = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
        explore = bool(overrides.pop("explore", False))
        data.update(overrides)
        config = SuffixConfig.from_dict(data)
        calibration = SourceCalibration.load(path / "calibration.json") if (path / "calibration.json").exists() \
            else None
        if calibration is None:
            log.warning("no calibration.json in %s: survival is the raw continuation frequency "
                        "(run `dspark suffix calibrate`)", path)
        index = None
        if "corpus" in config.sources:
            t0 = time.perf_counter()
            docs = read_responses(corpus_paths(config.corpus_dirs), config.heldout_fraction,
                                  max_tokens=config.corpus_max_tokens)
            index = SuffixIndex.cached(docs)
            log.info("suffix index: %d tokens from %d responses, %.0f MB, ready in %.1f s", index.num_tokens,
                     len(docs), index.nbytes / 2**20, time.perf_counter() - t0)
        return cls(index, calibration, config, explore)

    def _cells(self, source: str, regime: str) -> int:
        """Address of the calibration cells of (source, regime) as float32 for the native walk (0: none)."""
        key = (source, regime)
        entry = self._tables.get(key)
        if entry is None:
            cells = self.calibration.cells(source, regime, refreeze=False)  # new counts: at `feedback`'s refresh
            array = None if cells is None else np.asarray(cells, dtype=np.float32)
            # the array stays referenced beside its address (numpy's .ctypes.data costs microseconds a call)
            entry = self._tables[key] = (array, array.ctypes.data if array is not None else 0,
                                         list(self.calibration.bias.get(key, ())))
        return entry[1]

    def choose_batch(self, requests: list[DraftRequest], max_num_tokens: int) -> list[Proposal | None]:
        """Per request, the proposal with the most expected accepted tokens (None: no source has one). Both
        sources' walks for the whole batch run in one native call; in explore mode (calibration runs) the
        sources alternate deterministically instead."""
        self._num_rounds += 1
        n = len(requests)
        texts = []
        by_id = self._texts
        for req in requests:
            text = by_id.get(req.request_id)
            if text is None:
                text = by_id[req.request_id] = RequestText()
            text.sync(req.token_ids)
            texts.append(text)
        served: list[SuffixIndex | None] = [None] * n
        if self.served is not None:  # each request's tenant's store (whose text it joins on release)
            for r, req in enumerate(requests):
                tenant = self._tenants[req.request_id] = "" if self.config.share_served else req.tenant
                served[r] = self.served.index_for(tenant)
        regimes = {r.temperature > 0 for r in requests}
        # at T > 0 the choice weighs each source by the survival of the draft it will draw: the deterministic
        # walk's steps (q's mode, its support, ...) read in the regime of drafts drawn from q
        drawn = self.config.empirical_q
        tables = {t: tuple(self._cells(s, regime_of(float(t), drawn)) for s in _SOURCE_NAMES) for t in regimes}
        use = ("request" in self.config.sources, "corpus" in self.config.sources, self.served is not None)
        out = propose_batch(texts, self.index, served, self.config.walk, max_num_tokens,
                            [tables[r.temperature > 0] for r in requests], use, self._batch, self._work)
        self._batch = out
        has = out.k[:n] > 0  # (R, sources)
        for source, num in zip(_SOURCE_NAMES, has.sum(axis=0).tolist()):
            if source in self.stats:
                self.stats[source].num_proposals += num
        choice = out.chosen[:n].tolist()
        if self.explore:
            for r, req in enumerate(requests):
                candidates = [s for s in range(len(_SOURCE_NAMES)) if has[r, s]]
                if len(candidates) > 1:
                    choice[r] = candidates[(self._num_rounds + zlib.crc32(req.request_id.encode())) % len(candidates)]
        chosen: list[Proposal | None] = [None] * n
        to_draw: list[tuple[int, int]] = []  # (request, source) of the T > 0 requests: drawn from q below
        if drawn and True in regimes:
            to_draw = [(r, c) for r, c in enumerate(choice) if c >= 0 and requests[r].temperature > 0]
        drawing = {r for r, _ in to_draw}
        rows = [r for r, c in enumerate(choice) if c >= 0 and r not in drawing]  # the deterministic drafts
        sources = [choice[r] for r in rows]
        for r, c, walk in zip(rows, sources, out.walks(rows, sources)):
            t = requests[r].temperature
            chosen[r] = Proposal(_SOURCE_NAMES[c], walk, walk.conf, t, regime_of(t))
        if to_draw:
            self._draw(requests, chosen, texts, served, max_num_tokens, to_draw)
        if self.explore:
            for r, p in enumerate(chosen):
                if p is not None:
                    p.alternatives = tuple((_SOURCE_NAMES[s], out.walk(r, s)) for s in range(len(_SOURCE_NAMES))
                                           if has[r, s])
        return chosen

    def _draw(self, requests: list[DraftRequest], chosen: list[Proposal | None], texts: list[RequestText],
              served: list[SuffixIndex | None], max_num_tokens: int, to_draw: list[tuple[int, int]]) -> None:
        """The proposal of request r drawn from source c's q, for every (r, c) of `to_draw` (one native call for
        the batch). The sources were chosen from the deterministic walks before: nothing drawn here can change
        which source drafts or whether it drafts."""
        rows = [r for r, _ in to_draw]
        sources = [c for _, c in to_draw]
        tables = [self._cells(_SOURCE_NAMES[s], "empirical") for s in sources]
        uniforms = np.stack([self._rng(requests[r].request_id).random(max_num_tokens, dtype=np.float32)
                             for r in rows])
        out = sample_batch([texts[r] for r in rows], self.index, [served[r] for r in rows], self.config.walk,
                           max_num_tokens, sources, tables, uniforms, self._sampled, self._work)
        self._sampled = out
        for r, c, walk in zip(rows, sources, out.walks(len(rows))):
            if walk.tokens:
                chosen[r] = Proposal(_SOURCE_NAMES[c], walk, walk.conf, requests[r].temperature, "empirical")

    def _rng(self, request_id: str) -> np.random.Generator:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = self._rngs[request_id] = np.random.default_rng(zlib.crc32(request_id.encode()))
        return rng

    @staticmethod
    def q_rows(proposal: Proposal | None) -> SparseQ:
        """The draft distributions of a proposal: its q where it was drawn, else point masses."""
        if proposal is None:
            return SparseQ.point_masses([])
        w = proposal.walk
        return w.q if w.q is not None else SparseQ.point_masses(w.tokens)

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        t0 = time.perf_counter()
        before = {s: v.num_proposals for s, v in self.stats.items()}
        tokens: list[list[int]] = []
        confidences: list[list[float]] = []
        sources: list[str] = []
        proposals = self.choose_batch(requests, max_num_tokens)
        for req, best in zip(requests, proposals):
            self.last.pop(req.request_id, None)
            if best is None:
                tokens.append([])
                confidences.append([])
                sources.append("")
                continue
            self.stats[best.source].num_chosen += 1
            self.last[req.request_id] = best
            tokens.append(best.walk.tokens)
            confidences.append(best.conditional)
            sources.append(best.source)
        probs = None
        if any(p is not None and p.walk.q is not None for p in proposals):  # some were drawn from q
            probs = [self.q_rows(p) for p in proposals]
        self.propose_ms = (time.perf_counter() - t0) * 1e3
        return DraftOutput(tokens=tokens, probs=probs, confidences=confidences, sources=sources,
                           num_proposals={s: v.num_proposals - before[s] for s, v in self.stats.items()})

    def feedback(self, request_ids: list[str], num_verified: list[int], num_accepted: list[int]) -> None:
        """The engine's verdict on the latest round (per-source acceptance for metrics and calibration)."""
        for rid, n_ver, n_acc in zip(request_ids, num_verified, num_accepted):
            p = self.last.get(rid)
            if p is None or n_ver == 0:
                continue
            s = self.stats[p.source]
            s.num_verified += n_ver
            s.num_accepted += n_acc
            for k in range(min(n_acc, len(s.accepted_by_position))):
                s.accepted_by_position[k] += 1
            if self.config.live_calibration and not self.explore:
                w = p.walk
                self.calibration.record(p.source, p.regime, w.freq, w.count, w.match, n_ver, n_acc,
                                        predicted=p.conditional, bias_rate=self.config.live_bias_rate)
                self._num_live += min(n_ver, n_acc + 1)
        if self._num_live >= self.config.live_refresh_every:
            self._num_live = 0
            self.calibration.refreeze()  # the tables that took outcomes, once here (not at every shift's re-read)
            self._tables = {}  # re-read at the next round
        elif self.config.live_bias_rate > 0:  # a shift that moved: that source's cells re-read (~0.1 ms)
            bias = self.calibration.bias
            for key in [k for k, e in self._tables.items()
                        if _moved(bias.get(k, ()), e[2]) >= self.config.live_bias_refresh]:
                del self._tables[key]

    def source_stats(self) -> dict[str, dict]:
        return {s: asdict(v) for s, v in self.stats.items()}

    def reset_stats(self) -> None:
        self.stats = {s: SourceStats() for s in self.config.sources}

    def release(self, request_id: str) -> None:
        text = self._texts.pop(request_id, None)
        tenant = self._tenants.pop(request_id, "")
        if text is not None and self.served is not None:  # its text joins its tenant's served store
            self.served.add(tenant, text.tokens().copy())
        self.last.pop(request_id, None)
        self._rngs.pop(request_id, None)


def _moved(now: list[float], then: list[float]) -> float:
    """How far a source's live shift moved since its cells were read (the largest change of a position bin)."""
    return max((abs(a - b) for a, b in itertools.zip_longest(now, then, fillvalue=0.0)), default=0.0)
