"""HybridDrafter (`drafter: hybrid`): the cheap sources first, DSpark only where its draft pays for itself.

Per request and step:
1. the suffix drafter's sources (the request's own text, the global index of the target's text) propose
   at almost no cost, each with calibrated survival; the better one has E_c expected accepted tokens;
2. DSpark's forward runs for the set S of requests that maximises the batch's expected tokens per unit
   time, (Σ_r (1 + E_r)) / (R + C(|S|)): E_r is E_d for r in S, E_c otherwise. E_d is DSpark's accepted
   tokens on its recent rounds (a decayed mean, a round whose drafts the scheduler verified none of counting
   0; a prior until it has rounds) per regime and per band of E_c: DSpark is chosen where the cheap
   sources have little, and there it accepts far less than on average (8 prompts at batch 1 on a Xeon:
   11 of 93 verified tokens), so one mean over all its rounds would keep choosing it where it loses.
   R is the measured time of a round at this batch size without DSpark's forward, C(k) the measured time
   of DSpark's forward for k requests (with the projection of the context rows it has not seen since its
   last draft for them: the choice causes that work, DSpark projects lazily). The requests with the
   largest E_d − E_c join S first. One DSpark forward is paid by the whole batch: at batch 1 this is
   (1 + E_d) > (1 + E_c)(1 + C/R); at batch 8 a request whose free draft is short no longer justifies,
   alone, a forward that slows the other seven;
3. each request's chosen draft and its survival curve go to the prefix scheduler, which sets ℓ_r.

Under a load where the engine's draft gate measured drafting not to pay, the engine forgoes the requests'
features (`forgo_features`, `FeaturesOptional`): DSpark is out for them for good (its context would have a gap)
and they draft from the cheap sources alone; the taps, the feature copies and DSpark's projection of every
row cost the hybrid ~2 % at batch 32 where Algorithm 1 verified none of its drafts.

DSpark's features gate (`wants_features`): the features cost every round whether or not DSpark drafts, and on
a CPU where DSpark adds nothing beside the cheap sources (a Zen 4 EPYC: τ 2.06 with it against 2.05 without,
0.4 ms of drafting and ~0.3 ms of features a 15 ms step) they are pure cost. So the hybrid keeps a decayed
account of what DSpark was worth: each round, the tokens it was accepted beyond what the cheap sources
expected for the same requests (E_d's realised minus E_c), at the round's time per token, less the time of its
forward and of taking the features (`observe`, with DSpark's projection of queued rows). Once enough rounds are
counted and the account is negative, new requests go without features (the engine forgoes them), except one
in `_EXPLORE_EVERY`, whose rounds keep the account current: DSpark comes back where it pays again.

Why this is lossless: the choice of source for a request depends only on its context (the cheap drafts
and their calibrated survival are deterministic functions of its tokens; at T > 0 the chosen cheap source
then draws its draft from its q, after the choice) and on statistics of earlier, already verified rounds.
It is made before DSpark samples anything, so no sampled draft token can decide whether it is itself
verified (the failure mode of the paper's Appendix A). Whatever source is chosen, verification accepts its
tokens by min(1, p/q) (q a point mass for the deterministic drafts, DSpark's own distribution for its
samples, the cheap source's q for its drawn drafts) and resamples the residual, so every source's output is
the target's distribution; a mixture of sources chosen independently of the draft's randomness is too.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import asdict

import torch

from dspark.models.drafters.base import DEFAULT_CHECKPOINTS, DraftOutput, DraftRequest, FeatureDrafter, SparseQ
from dspark.models.drafters.suffix.drafter import DEFAULT_SUFFIX_DIR, Proposal, SourceStats, SuffixDrafter
from dspark.models.target.loader import TargetModel
from dspark.spec.source_calibration import regime_of

log = logging.getLogger(__name__)

_PRIOR_MODEL_TOKENS = {"greedy": 0.8, "sampled": 0.6}  # DSpark's τ − 1 in `dspark eval` (1.8 / 1.6)
_PRIOR_ROUNDS = 4.0  # the prior's weight in rounds: one unlucky first round must not shut DSpark out
_BANDS = (0.25, 0.5, 1.0, 2.0)  # upper edges of the E_c bands DSpark's acceptance is kept apart for
_DECAY = 0.98
_VALUE_DECAY = 0.98  # per round, for DSpark's account (a window of ~50 rounds)
_MIN_ROUNDS = 32.0  # decayed rounds counted (~50 rounds) before the account may close the features gate
_EXPLORE_EVERY = 16  # while the gate is closed, one new request in this many keeps its features


class HybridDrafter:
    """Suffix sources and (optionally) a feature drafter, chosen per request (a `FeatureDrafter`)."""

    name = "hybrid"
    features_optional = True  # its cheap sources draft a request whose features were forgone

    def __init__(self, suffix: SuffixDrafter, model: FeatureDrafter | None = None,
                 model_cost_ratio: float | None = None) -> None:
        self.suffix = suffix
        self.feature_drafter = model
        self.hidden_layers: tuple[int, ...] = tuple(getattr(model, "hidden_layers", ())) if model else ()
        self.block_size = getattr(model, "block_size", 7)
        self._fixed_ratio = model_cost_ratio  # tests and what-ifs: C(k) = ratio · R; None: measured
        # decayed sums per (regime, E_c band): DSpark's accepted tokens and rounds (seeded with _PRIOR_ROUNDS
        # prior rounds)
        keys = [(r, b) for r in _PRIOR_MODEL_TOKENS for b in range(len(_BANDS) + 1)]
        self._model_acc = {k: _PRIOR_ROUNDS * _PRIOR_MODEL_TOKENS[k[0]] for k in keys}
        self._model_rounds = {k: _PRIOR_ROUNDS for k in keys}
        self._model_ms: dict[int, float] = {}  # C(k): decayed mean of DSpark's forward for k requests
        self._model_warm: set[int] = set()  # sizes whose first (cold) forward was seen
        self._round_ms: dict[int, float] = {}  # R(B): decayed mean of a round at batch B, DSpark's forward out
        self._open_round: tuple[float, float, int] | None = None  # this round's start, DSpark ms, batch size
        self._chosen_model: dict[str, tuple[str, int]] = {}  # request id -> (regime, band) of its DSpark draft
        self._forgone: set[str] = set()  # requests the engine feeds no features any more: cheap sources only
        self.model_stats = SourceStats()
        # DSpark's account (the features gate): decayed ms it gained (or lost) a round, and rounds counted
        self._value_ms = 0.0
        self._value_rounds = 0.0
        self._observe_ms = 0.0  # time taking features since the last verdict
        self._chosen_free: dict[str, float] = {}  # request -> E_c of the cheap draft DSpark replaced
        self._seen: set[str] = set()  # requests asked `wants_features` already
        self._explorers: set[str] = set()  # requests that keep their features while the gate is closed
        self._num_new = 0

    @classmethod
    def build(cls, target: TargetModel, path: str | None = None, suffix_path: str | None = None,
              use_model: bool = True, **suffix_overrides: object) -> HybridDrafter:
        """The suffix drafter from `suffix_path` and DSpark from `path` (default: the shipped ones); without a
        DSpark checkpoint the hybrid is the suffix sources alone (logged)."""
        from dspark.models.drafters.dspark.drafter import DSparkDrafter

        suffix = SuffixDrafter.from_pretrained(suffix_path or DEFAULT_SUFFIX_DIR, **suffix_overrides)
        model = None
        ckpt = path or DEFAULT_CHECKPOINTS["dspark"]
        if use_model:
            try:
                model = DSparkDrafter.from_pretrained(ckpt, target)
            except (OSError, ValueError) as exc:
                log.warning("hybrid drafter without DSpark (%s): suffix sources only", exc)
        return cls(suffix, model)

    # ---- the FeatureDrafter interface ------------------------------------------------------------
    def observe(self, request_id: str, features: torch.Tensor) -> None:
        if self.feature_drafter is not None and request_id not in self._forgone:
            t0 = time.perf_counter()
            self.feature_drafter.observe(request_id, features)
            self._observe_ms += (time.perf_counter() - t0) * 1e3

    @property
    def features_pay(self) -> bool:
        """Whether DSpark's account says its features pay (open until enough rounds are counted)."""
        return self.feature_drafter is not None and (self._value_rounds < _MIN_ROUNDS or self._value_ms >= 0.0)

    def wants_features(self, request_id: str) -> bool:
        """Whether the engine should go on tapping and feeding this request's features: while DSpark's account
        is open, every request; while closed, only the explorers (one new request in `_EXPLORE_EVERY`, chosen
        when it is first asked about). A request declined is forgone from then on (`forgo_features`), whatever
        the engine does next. Lossless: it depends on arrival order and past rounds, not on tokens."""
        if self.feature_drafter is None or request_id in self._forgone:
            return False
        if request_id not in self._seen:
            self._seen.add(request_id)
            self._num_new += 1
            if not self.features_pay and self._num_new % _EXPLORE_EVERY == 0:
                self._explorers.add(request_id)
        keep = self.features_pay or request_id in self._explorers
        if not keep:  # declined is forgone here at once: DSpark must never draft it from a context with a gap
            self.forgo_features(request_id)  # (decoupled: the verify side hears of it with this round's reply)
        return keep

    def forgo_features(self, request_id: str) -> None:
        """From now on this request is drafted from the cheap sources alone (`FeaturesOptional`): DSpark's
        context for it would have a gap."""
        if self.feature_drafter is not None and request_id not in self._forgone:
            self._forgone.add(request_id)
            self.feature_drafter.release(request_id)

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        start = time.perf_counter()
        before = {s: v.num_proposals for s, v in self.suffix.stats.items()}
        cheap: list[Proposal | None] = self.suffix.choose_batch(requests, max_num_tokens)
        use_model, keys = self._choose_model(cheap, requests)
        tokens: list[list[int]] = []
        sources: list[str] = []
        confidences: list[list[float]] = []
        drawn: list[int] = []  # cheap drafts drawn from their source's q (T > 0): they carry it
        last, stats = self.suffix.last, self.suffix.stats
        for i, (r, p, m) in enumerate(zip(requests, cheap, use_model)):  # the cheap drafts kept (DSpark's: below)
            if p is None or m:
                last.pop(r.request_id, None)
                tokens.append([])
                sources.append("")
                confidences.append([])
                continue
            stats[p.source].num_chosen += 1
            last[r.request_id] = p  # until its verdict or release
            tokens.append(p.walk.tokens)
            sources.append(p.source)
            confidences.append(p.conditional)
            if p.walk.q is not None:
                drawn.append(i)
        probs: list[torch.Tensor] | None = None
        model_ms = 0.0
        if self._chosen_model:  # per request: the latest round's choice, until its verdict or release
            for r in requests:
                self._chosen_model.pop(r.request_id, None)
                self._chosen_free.pop(r.request_id, None)
        picked = [i for i, m in enumerate(use_model) if m]
        if picked:
            t0 = time.perf_counter()
            out = self.feature_drafter.propose([requests[i] for i in picked], max_num_tokens)  # type: ignore[union-attr]
            model_ms = (time.perf_counter() - t0) * 1e3
            if len(picked) in self._model_warm:  # a size's first forward sets up kernels and buffers: not its cost
                _fold(self._model_ms, len(picked), model_ms)
            self._model_warm.add(len(picked))
            for j, i in enumerate(picked):
                tokens[i] = out.tokens[j]
                confidences[i] = out.confidences[j] if out.confidences is not None else [0.5] * len(out.tokens[j])
                self._chosen_model[requests[i].request_id] = keys[i]
                self._chosen_free[requests[i].request_id] = cheap[i].expected_tokens if cheap[i] else 0.0
                sources[i] = "dspark" if tokens[i] else ""
            if out.probs is not None:
                probs = self._point_masses(tokens)
                for j, i in enumerate(picked):
                    probs[i] = out.probs[j]
        if drawn:
            probs = probs if probs is not None else self._point_masses(tokens)
            for i in drawn:
                probs[i] = self.suffix.q_rows(cheap[i])
        self.model_stats.num_proposals += len(picked)
        self.model_stats.num_chosen += len(picked)
        proposals = {s: v.num_proposals - before[s] for s, v in self.suffix.stats.items()}
        proposals["dspark"] = len(picked)
        self._open_round = (start, model_ms, len(requests))
        return DraftOutput(tokens=tokens, probs=probs, confidences=confidences, sources=sources,
                           num_proposals=proposals)

    @staticmethod
    def _point_masses(tokens: list[list[int]]) -> list[torch.Tensor | SparseQ]:
        """Point-mass q rows for the deterministic drafts of a batch whose sampled drafts carry q."""
        return [SparseQ.point_masses(t) for t in tokens]

    def _choose_model(self, cheap: list[Proposal | None],
                      requests: list[DraftRequest]) -> tuple[list[bool], list[tuple[str, int]]]:
        """Per request, whether DSpark drafts it: the set that maximises the batch's expected tokens per unit
        time (see the module docstring), and the (regime, E_c band) its verdict is kept under (no keys where no
        request can be chosen: no DSpark, or every request's features forgone). Depends on the
        requests' contexts (through the deterministic cheap drafts) and on past rounds only."""
        chosen = [False] * len(requests)
        if self.feature_drafter is None or all(r.request_id in self._forgone for r in requests):
            return chosen, []  # none can be chosen (no keys to keep)
        expected = [p.expected_tokens if p is not None else 0.0 for p in cheap]
        keys = [(regime_of(r.temperature), bisect.bisect_right(_BANDS, e)) for r, e in zip(requests, expected)]
        free = [1.0 + e for e in expected]
        gain = [1.0 + self._model_acc[k] / self._model_rounds[k] - f if r.request_id not in self._forgone else 0.0
                for f, k, r in zip(free, keys, requests)]
        order = sorted((i for i, g in enumerate(gain) if g > 0), key=lambda i: -gain[i])
        round_ms = self._nearest(self._round_ms, len(requests)) or 1.0
        tokens = sum(free)
        best_k, best_rate = 0, tokens / round_ms
        for k, i in enumerate(order, start=1):
            tokens += gain[i]
            rate = tokens / (round_ms + self.model_cost_ms(k, round_ms))
            if rate > best_rate:
                best_k, best_rate = k, rate
        for i in order[:best_k]:
            chosen[i] = True
        return chosen, keys

    def model_cost_ms(self, num_requests: int, round_ms: float) -> float:
        """C(k): DSpark's forward for k requests, measured (the nearest measured k); before any is measured,
        or with a fixed ratio, that ratio (default 0.25) of a round."""
        if self._fixed_ratio is not None:
            return self._fixed_ratio * round_ms
        measured = self._nearest(self._model_ms, num_requests)
        return measured if measured is not None else 0.25 * round_ms

    @staticmethod
    def _nearest(table: dict[int, float], size: int) -> float | None:
        if not table:
            return None
        return table[min(table, key=lambda k: (abs(k - size), k))]

    def feedback(self, request_ids: list[str], num_verified: list[int], num_accepted: list[int]) -> None:
        """The engine's verdict on the latest round: per-source counts, and DSpark's accepted tokens per
        verified round (per regime) for the next rounds' choices."""
        if self._open_round is not None:  # the round's time without DSpark's forward: R(B)
            start, model_ms, size = self._open_round
            round_ms = (time.perf_counter() - start) * 1e3
            _fold(self._round_ms, size, round_ms - model_ms)
            self._open_round = None
            self._count_value(request_ids, num_accepted, round_ms, model_ms, size)
        self.suffix.feedback(request_ids, num_verified, num_accepted)
        for rid, n_ver, n_acc in zip(request_ids, num_verified, num_accepted):
            key = self._chosen_model.get(rid)
            if key is None:
                continue
            # a DSpark draft the scheduler verified none of still cost its forward: a round with 0 tokens gained
            self._model_acc[key] = _DECAY * self._model_acc[key] + n_acc
            self._model_rounds[key] = _DECAY * self._model_rounds[key] + 1.0
            if n_ver == 0:
                continue
            s = self.model_stats
            s.num_verified += n_ver
            s.num_accepted += n_acc
            for k in range(min(n_acc, len(s.accepted_by_position))):
                s.accepted_by_position[k] += 1

    def _count_value(self, request_ids: list[str], num_accepted: list[int], round_ms: float, model_ms: float,
                     size: int) -> None:
        """DSpark's account for the latest round: its accepted tokens beyond the cheap drafts' E_c at the round's
        ms per token, less its forward and the features taken since the last round."""
        if self.feature_drafter is None:
            return
        extra = sum(a - self._chosen_free[r] for r, a in zip(request_ids, num_accepted) if r in self._chosen_free)
        ms_per_token = round_ms / max(1, size + sum(num_accepted))
        was_open = self.features_pay
        self._value_ms = _VALUE_DECAY * self._value_ms + extra * ms_per_token - model_ms - self._observe_ms
        self._value_rounds = _VALUE_DECAY * self._value_rounds + 1.0
        self._observe_ms = 0.0
        if self.features_pay != was_open:
            log.info("hybrid: DSpark's features %s (account %.2f ms over ~%d rounds)",
                     "pay again: every new request keeps them" if self.features_pay
                     else "do not pay: new requests go without them", self._value_ms, round(self._value_rounds))

    def source_stats(self) -> dict[str, dict]:
        return {**self.suffix.source_stats(), "dspark": asdict(self.model_stats)}

    def reset_stats(self) -> None:
        self.suffix.reset_stats()
        self.model_stats = SourceStats()

    def release(self, request_id: str) -> None:
        self.suffix.release(request_id)
        self._chosen_model.pop(request_id, None)
        self._chosen_free.pop(request_id, None)
        self._forgone.discard(request_id)
        self._seen.discard(request_id)
        self._explorers.discard(request_id)
        if self.feature_drafter is not None:
            self.feature_drafter.release(request_id)


def _fold(table: dict[int, float], key: int, value: float, decay: float = 0.9, outlier: float = 3.0) -> None:
    """A decayed mean of times per key (the first value as it is), a sample counting at most `outlier` × the
    mean: one slow round (a cold kernel, a preempted core) must not keep DSpark out for good, since a C(k)
    that never wins is never measured again."""
    if key not in table:
        table[key] = value
    else:
        table[key] = decay * table[key] + (1 - decay) * min(value, outlier * table[key])
