"""The speculative-decoding engine: continuous batching over one target runner and one drafter.

A step reads as four phases: draft (the drafter proposes up to γ tokens per request), schedule (the
prefix scheduler picks ℓ_r per request from survival estimates and the SPS table), verify (ONE
flattened target forward over all requests' 1 + ℓ_r tokens, then lossless acceptance), commit (append
accepted tokens, roll back the cache by length, apply stop conditions, release finished requests).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.models.drafter import Drafter, DraftOutput, DraftRequest, make_drafter
from dspark.models.dtype_choice import chosen_dtype
from dspark.models.generic_runner import GenericRunner
from dspark.models.runner import ForwardOutput, SeqChunk, TargetRunner
from dspark.models.target import DEFAULT_TARGET, TargetModel, cache_dir, load_target
from dspark.spec.draft_gate import DraftGate
from dspark.spec.logprobs import token_logprobs
from dspark.spec.nucleus import sample_nucleus
from dspark.spec.schedulers import make_scheduler
from dspark.spec.sps import SPSTable
from dspark.spec.survival import AcceptanceTracker, prefix_survival
from dspark.spec.verification import verify
from dspark.verify_service.batch import build_verify_input
from dspark.verify_service.prefix_cache import BLOCK as PREFIX_BLOCK
from dspark.verify_service.prefix_cache import PrefixCache
from dspark.verify_service.profiles import profile_for, recorded_dtype_choice
from dspark.verify_service.request import (
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    StepStats,
    validate_request,
)
from dspark.verify_service.stopping import append_with_stops

log = logging.getLogger(__name__)



@dataclass
class EngineConfig:
    target: str = DEFAULT_TARGET
    device: str = "cpu"
    dtype: str | None = None  # None: fp32 on CPU, bf16 on GPU; "auto": the fastest for dtype_role, measured
    dtype_role: str = "verify"  # which operating point "auto" optimises: verify | draft | generate
    drafter: str = "ngram"
    drafter_kwargs: dict = field(default_factory=dict)
    scheduler: str = "fixed"
    scheduler_kwargs: dict = field(default_factory=dict)
    num_draft_tokens: int = 7  # γ: the most a drafter proposes per request and step
    sps_profile: str | None = None  # JSON from `dspark profile`; None: the profile of this machine (profiles.py)
    max_num_seqs: int = 16
    max_model_len: int = 2048
    num_threads: int | None = None
    # skip drafting at batch sizes where it measurably costs more than it returns (load-aware
    # schedulers only: a fixed k always drafts); see spec/draft_gate.py
    draft_gate: bool = True
    # steps kept in `Engine.stats` (None: all, for benchmarks that read and clear them); a long-running
    # server keeps a window, else per-step records would grow without bound
    max_step_stats: int | None = None
    # a streaming caller that fell behind gets the steps it missed as one output (AsyncEngine)
    merge_stream_outputs: bool = False  # measured: no gain over HTTP here (docs/results/engine)
    # prompt-prefix K/V kept for reuse (prefix_cache.py), MiB; 0 turns automatic prefix caching off
    prefix_cache_mb: int = 256
    # auto: the flattened runner for a family family.py describes, the generic transformers path for any other;
    # transformers: the generic path for every target (what being generic costs, or to rule the native path out)
    model_impl: str = "auto"


def resolve_dtype(config: EngineConfig) -> str | None:
    """The configured dtype, with "auto" replaced by the one measured fastest for the config's role."""
    if config.dtype != "auto":
        return config.dtype
    recorded = recorded_dtype_choice(config.target, config.device)
    return chosen_dtype(config.dtype_role, config.target, config.device, cache_dir(), recorded)


def load_sps(config: EngineConfig, target: TargetModel) -> SPSTable:
    """The configured profile, else the one measured on this machine for this target and dtype."""
    if config.sps_profile:
        path = Path(config.sps_profile)
        if not path.exists():
            raise FileNotFoundError(f"SPS profile {path} not found: run `dspark profile --out {path}`")
        table = SPSTable.from_file(path)
    else:
        table, _ = profile_for(target)
    return table.monotone()


# Prompts prefilled per forward: attention pads every prompt of a forward to the longest, so one
# forward over 256 prompts of ~60 tokens costs 2.6x what four forwards of 64 cost (SmolLM2, bf16).
MAX_PREFILL_REQUESTS = 64
MAX_PREFILL_TOKENS = 4096


def _prefill_groups(reqs: list[Request], sizes: list[int] | None = None, max_requests: int = MAX_PREFILL_REQUESTS,
                    max_tokens: int = MAX_PREFILL_TOKENS) -> list[list[Request]]:
    """Consecutive runs of requests (newly admitted ones: their slots are contiguous) within both caps, one
    forward each; `sizes`: the tokens each brings (default: its prompt)."""
    groups: list[list[Request]] = [[]]
    num_tokens = 0
    for req, n in zip(reqs, sizes if sizes is not None else [len(r.prompt_ids) for r in reqs]):
        if groups[-1] and (len(groups[-1]) >= max_requests or num_tokens + n > max_tokens):
            groups.append([])
            num_tokens = 0
        groups[-1].append(req)
        num_tokens += n
    return groups


def _make_runner(config: EngineConfig, target: TargetModel, row_invariant: bool = True) -> TargetRunner:
    """The runner `config.model_impl` asks for (see EngineConfig)."""
    if config.model_impl == "auto":
        return TargetRunner(target.model, config.max_num_seqs, config.max_model_len, row_invariant=row_invariant)
    if config.model_impl == "transformers":
        return GenericRunner(target.model, config.max_num_seqs, config.max_model_len,  # type: ignore[return-value]
                             row_invariant=row_invariant)
    raise ValueError(f"model_impl must be auto or transformers, not {config.model_impl!r}")


def _is_lossless_dtype(runner: TargetRunner, model: torch.nn.Module) -> bool:
    """False for a low-precision verify runner that is not row-invariant on this CPU: speculation in it would
    drift from target-only decoding in that dtype (models/row_invariance.py)."""
    from dspark.models.row_invariance import is_row_invariant

    return not (runner.device.type == "cpu" and runner.row_invariant
                and runner.dtype in (torch.bfloat16, torch.float16) and not is_row_invariant(model))


class Engine:
    """Serves many requests at once; output follows the target's distribution exactly."""

    def __init__(self, config: EngineConfig, target: TargetModel | None = None,
                 drafter: Drafter | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.target = target or load_target(config.target, config.device, resolve_dtype(config))
        # bulk generation is compared with nothing: it may use kernels whose rounding varies with the batch
        self.runner = _make_runner(config, self.target, row_invariant=config.dtype_role != "generate")
        if (drafter is not None or config.drafter != "none") and not _is_lossless_dtype(self.runner,
                                                                                         self.target.model):
            dtype = str(self.runner.dtype).removeprefix("torch.")
            if config.dtype != "auto" or target is not None:
                raise ValueError(f"speculative decoding in {dtype} is not lossless on this CPU: a verify step's "
                                 "logits change with the number of tokens it carries. Use dtype fp32, or auto "
                                 "(the measured fastest verify dtype), or no drafter")
            log.warning("dtype auto chose %s, whose verify step is not row-invariant on this CPU: fp32", dtype)
            self.target = load_target(config.target, config.device, "fp32")
            self.runner = _make_runner(config, self.target)
        self.tokenizer = self.target.tokenizer
        self.eos_ids = self.target.eos_token_ids
        self.drafter = drafter if drafter is not None else make_drafter(
            config.drafter, self.target, **config.drafter_kwargs)
        # target layers whose hidden states the drafter consumes (DSpark-style context features)
        self.hidden_layers: tuple[int, ...] = tuple(getattr(self.drafter, "hidden_layers", ()))
        self.scheduler = make_scheduler(config.scheduler, **config.scheduler_kwargs)
        self.sps = load_sps(config, self.target) if config.scheduler != "fixed" else None
        self.tracker = AcceptanceTracker(max(1, config.num_draft_tokens))
        self.gate = DraftGate() if config.draft_gate and self.sps is not None else None
        self._last_round: tuple[float, float] | None = None  # perf_counter start and end of the last round
        self._prefill_ms = 0.0  # admission (prefill) time since the last round, kept out of the gate's O
        self._rider_logits: torch.Tensor | None = None  # the riders' logits of the last round (see _round)
        # off on the generic runner (generic_runner.py): its requests keep HF caches, no shared K/V rows
        self.prefix_cache = (PrefixCache(config.prefix_cache_mb * 2**20)
                             if config.prefix_cache_mb > 0 and getattr(self.runner, "supports_prefix_cache", True)
                             else None)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # index i holds the request in cache slot i
        self.stats: list[StepStats] = []
        self.num_steps = 0  # every step ever taken (`stats` may hold only the latest)
        self._ids = itertools.count()

    # ---- request lifecycle -------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        self.validate(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        gen = None
        if not params.is_greedy:
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        self.waiting.append(Request(rid, list(prompt_ids), params, gen))
        return rid

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (a client error) if this request can never be served."""
        validate_request(prompt_ids, params, self.config.num_draft_tokens, self.config.max_model_len,
                         self.runner.vocab_size)

    def abort(self, request_id: str) -> None:
        for req in self.waiting + self.running:
            if req.request_id == request_id and not req.is_finished:
                req.finish_reason = FinishReason.ABORT

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill), then one draft-schedule-verify-commit round.

        Target-only on the native-attention path: the prompts admitted this step ride in the same forward
        as the running requests' tokens (`_fused_admission_step`): one pass over the weights, not two."""
        outputs = self._reap_aborted()
        active = [r for r in self.running if not r.is_finished]
        if active and self.waiting and self._can_fuse_admission():
            outputs += self._fused_admission_step(active)
            self._release_finished()
            return outputs
        outputs += self._admit()
        active = [r for r in self.running if not r.is_finished]
        if active:
            outputs += self._round(active, lambda: self._draft(active))
        self._release_finished()
        return outputs

    def _can_fuse_admission(self) -> bool:
        """Plain steps only (no drafter, so no gate and no features) and attention that takes any mix of
        chunk lengths per token (the native path; the bf16 verify path's padded SDPA keeps separate steps)."""
        return self.drafter is None and self.gate is None and self.runner.native_attention

    def _fused_admission_step(self, active: list[Request]) -> list[RequestOutput]:
        """Admit what fits in one prefill group and decode `active` in ONE forward. Over HTTP at C = 32 a
        step was half prefill of arriving requests (py-spy, `docs/results/serve` run 21); as separate
        forwards each read all weights and paid the per-forward work. New requests get their first token
        here and their next one at the next step; what any request samples is unchanged (`_sample_plain`
        per request, its own generator)."""
        free = self.config.max_num_seqs - len(self.running)
        group = _prefill_groups(self.waiting[:free])[0] if free > 0 else []
        if not group:
            return self._round(active, lambda: DraftOutput(tokens=[[] for _ in active]))
        if not self.runner.takes_native_attention([SeqChunk(0, 0, r.prompt_ids, 1) for r in group]):
            outputs = self._admit()  # a long prompt: its own forward (SDPA), as without fusing
            return outputs + self._round(active, lambda: DraftOutput(tokens=[[] for _ in active]))
        t0 = time.perf_counter()
        self.waiting = self.waiting[len(group):]
        for req in group:
            req.slot = self.runner.cache.allocate()
            self.running.append(req)
        hits = [self.prefix_cache.match(r.prompt_ids) if self.prefix_cache is not None else [] for r in group]
        start = [len(h) * PREFIX_BLOCK for h in hits]
        for req, h in zip(group, hits):
            PrefixCache.load(h, self.runner.cache, req.slot)
        riders = [SeqChunk(r.slot, s, r.prompt_ids[s:], 1) for r, s in zip(group, start)]
        outputs = self._round(active, lambda: DraftOutput(tokens=[[] for _ in active]), riders=riders)
        logits = self._rider_logits
        self._rider_logits = None
        for req in group:
            if self.prefix_cache is not None:
                self.prefix_cache.store(req.prompt_ids, self.runner.cache, req.slot, None)
        tokens = self._sample_plain(group, logits)
        self._note_logprobs(group, logits, [[i] for i in range(len(group))], [[t] for t in tokens])
        first = self._first_tokens(group, tokens)
        self._prefill_ms += (time.perf_counter() - t0) * 1e3
        return first + outputs

    def _round(self, active: list[Request], get_draft: Callable[[], DraftOutput],
               micro_batch: int = 0, extra_draft_ms: float = 0.0,
               riders: list[SeqChunk] | None = None) -> list[RequestOutput]:
        """draft (from `get_draft`) → schedule → verify → commit for `active`, timed into `self.stats`.

        `extra_draft_ms`: drafting time this round already paid outside `get_draft` (a pipelined
        engine drafts locally at submit time), for the draft gate's cost estimate.
        `riders`: prompt chunks computed in the verify forward, ahead of the round's own (their logits are
        left in `self._rider_logits`).
        """
        start_s = time.time()
        t0 = time.perf_counter()
        if self.gate is not None and self._last_round is not None:
            # prefill of newly admitted requests is paid whether or not steps draft: not overhead O.
            # An idle wait counts at most one round's length.
            last_start, last_end = self._last_round
            gap_ms = (t0 - last_end) * 1e3 - self._prefill_ms
            self.gate.note_overhead(min(gap_ms, (last_end - last_start) * 1e3))
        self._prefill_ms = 0.0
        draft = get_draft()
        t1 = time.perf_counter()
        lengths = self._schedule(active, draft)
        t2 = time.perf_counter()
        accepted, next_tokens = self._verify(active, draft, lengths, riders)
        t3 = time.perf_counter()
        outputs = self._commit(active, draft, lengths, accepted, next_tokens)
        if self.gate is not None:  # the round's measured time, drafting on the critical path included
            round_ms = (time.perf_counter() - t0) * 1e3 + extra_draft_ms
            if any(draft.tokens):
                self.gate.record(len(active), sum(lengths), sum(accepted), round_ms, (t3 - t2) * 1e3,
                                 self.sps)  # type: ignore[arg-type]
            else:
                self.gate.record_plain(len(active), round_ms)
        self.stats.append(StepStats(len(active), sum(lengths) + len(active), lengths, accepted,
                                    (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, draft.confidences,
                                    micro_batch, start_s, time.time(), draft.sources, draft.num_proposals))
        self.num_steps += 1
        keep = self.config.max_step_stats
        if keep is not None and len(self.stats) >= 2 * keep:  # amortised: trim once per `keep` steps
            del self.stats[:-keep]
        self._last_round = (t0, time.perf_counter())
        return outputs

    def _admit(self) -> list[RequestOutput]:
        free = self.config.max_num_seqs - len(self.running)
        new, self.waiting = self.waiting[:free], self.waiting[free:]
        if not new:
            return []
        t0 = time.perf_counter()
        for req in new:
            req.slot = self.runner.cache.allocate()
            self.running.append(req)
        # prompt blocks seen before come from the prefix cache; only the rest is computed
        hits = [self.prefix_cache.match(r.prompt_ids) if self.prefix_cache is not None else [] for r in new]
        start = {r.request_id: len(h) * PREFIX_BLOCK for r, h in zip(new, hits)}
        cached_feats = {r.request_id: PrefixCache.load(h, self.runner.cache, r.slot) for r, h in zip(new, hits)}
        first: list[int] = []
        for group in _prefill_groups(new, [len(r.prompt_ids) - start[r.request_id] for r in new]):
            out = self.runner.forward([SeqChunk(r.slot, start[r.request_id], r.prompt_ids[start[r.request_id]:], 1)
                                       for r in group], self.hidden_layers)
            feats = self._prompt_features(group, [start[r.request_id] for r in group],
                                          [cached_feats[r.request_id] for r in group], out)
            for req, f in zip(group, feats):
                if self.drafter is not None and f is not None:
                    self.drafter.observe(req.request_id, f)  # type: ignore[attr-defined]
                if self.prefix_cache is not None:
                    self.prefix_cache.store(req.prompt_ids, self.runner.cache, req.slot, f)
            tokens = self._sample_plain(group, out.logits)
            self._note_logprobs(group, out.logits, [[i] for i in range(len(group))], [[t] for t in tokens])
            first += tokens
        outputs = self._first_tokens(new, first)
        self._prefill_ms += (time.perf_counter() - t0) * 1e3
        return outputs

    def _first_tokens(self, reqs: list[Request], tokens: list[int]) -> list[RequestOutput]:
        """Prefilled requests: their whole prompt is cached now; emit each one's first token."""
        now = time.perf_counter()
        outputs = []
        for req, tok in zip(reqs, tokens):
            req.num_cached = len(req.prompt_ids)
            self.runner.cache.lengths[req.slot] = req.num_cached
            req.first_token_s = now
            outputs.append(self._emit(req, [tok]))
        return outputs

    def _draft(self, active: list[Request]) -> DraftOutput:
        gamma = self.config.num_draft_tokens
        if self.drafter is None or gamma == 0 or not self._gate_allows(len(active)):
            return DraftOutput(tokens=[[] for _ in active])
        reqs = [DraftRequest(r.request_id, r.token_ids, r.params.temperature, r.params.tenant) for r in active]
        return self.drafter.propose(reqs, gamma)

    def _gate_allows(self, batch_size: int) -> bool:
        return self.gate is None or self.gate.should_draft(batch_size)

    def _schedule(self, active: list[Request], draft: DraftOutput) -> list[int]:
        proposed = [len(t) for t in draft.tokens]
        if draft.confidences is not None:
            conf = torch.zeros(len(active), max(proposed, default=0) or 1)
            for r, c in enumerate(draft.confidences):
                conf[r, :len(c)] = torch.tensor(c)
            survival = [row[:k] for row, k in
                        zip(prefix_survival(conf, torch.tensor(proposed)).tolist(), proposed)]
        else:
            survival = self.tracker.survival(proposed)
        lengths = self.scheduler.schedule(survival, self.sps)  # type: ignore[arg-type]
        # never verify past max_tokens: caps depend on request state only, not on draft tokens
        return [max(0, min(n, r.num_remaining - 1)) for n, r in zip(lengths, active)]

    def _verify(self, active: list[Request], draft: DraftOutput, lengths: list[int],
                riders: list[SeqChunk] | None = None) -> tuple[list[int], list[int]]:
        chunks = [SeqChunk(r.slot, r.num_cached, [r.token_ids[-1]] + d[:n], n + 1)
                  for r, d, n in zip(active, draft.tokens, lengths)]
        out = self.runner.forward((riders or []) + chunks, self.hidden_layers)
        if riders:  # plain rounds only (`_can_fuse_admission`): no hidden states to split
            num_rider_logits = sum(c.num_logits for c in riders)
            self._rider_logits = out.logits[:num_rider_logits]
            out = ForwardOutput(out.logits[num_rider_logits:], out.hidden_states)
        num_accepted, next_token = self._accept(active, draft, lengths, out.logits)
        if any(r.params.logprobs is not None for r in active):
            first_row = list(itertools.accumulate((n + 1 for n in lengths), initial=0))
            rows = [list(range(f, f + n + 1)) for f, n in zip(first_row, num_accepted)]  # accepted drafts, then last
            self._note_logprobs(active, out.logits, rows,
                                [d[:n] + [t] for d, n, t in zip(draft.tokens, num_accepted, next_token)])
        # the drafter sees target features of exactly the tokens that stay in the cache
        self._feed_drafter(active, [n + 1 for n in lengths], [n + 1 for n in num_accepted], out)
        return num_accepted, next_token

    def _accept(self, active: list[Request], draft: DraftOutput, lengths: list[int],
                logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Lossless acceptance over the step's logits (rows: each request's ℓ_r drafts, then its bonus).

        On CPU, requests verifying nothing are sampled by `_sample_plain` (also inside a step where
        others verify), so what a request draws from its generator never depends on its batch.
        """
        plain = [i for i, n in enumerate(lengths) if n == 0]
        if logits.device.type != "cpu" or not plain:
            result = verify(build_verify_input(logits, active, draft.tokens, draft.probs, lengths))
            return result.num_accepted, result.next_token
        if len(plain) == len(active):  # a plain target step: nothing to verify, one sample per request
            return [0] * len(active), self._sample_plain(active, logits)
        first_row = list(itertools.accumulate((n + 1 for n in lengths), initial=0))
        drafted = [i for i, n in enumerate(lengths) if n > 0]
        rows = torch.tensor([r for i in drafted for r in range(first_row[i], first_row[i + 1])])
        probs = [draft.probs[i] for i in drafted] if draft.probs is not None else None
        result = verify(build_verify_input(logits[rows], [active[i] for i in drafted],
                                           [draft.tokens[i] for i in drafted], probs, [lengths[i] for i in drafted]))
        plain_tokens = self._sample_plain([active[i] for i in plain], logits[[first_row[i] for i in plain]])
        num_accepted, next_token = [0] * len(active), [0] * len(active)
        for i, n_acc, tok in zip(drafted, result.num_accepted, result.next_token):
            num_accepted[i], next_token[i] = n_acc, tok
        for i, tok in zip(plain, plain_tokens):
            next_token[i] = tok
        return num_accepted, next_token

    def _note_logprobs(self, reqs: list[Request], logits: torch.Tensor, rows: list[list[int]],
                       tokens: list[list[int]]) -> None:
        """Target logprobs of the tokens this step emits, for the requests that asked (see spec/logprobs)."""
        for req, r_rows, r_tokens in zip(reqs, rows, tokens):
            if req.params.logprobs is not None:
                req.pending_logprobs = token_logprobs(logits, r_rows, r_tokens, req.params.logprobs)

    def _sample_plain(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """One token per request from its filtered target distribution (logits (R, V)).

        On CPU the sparse nucleus sampler (no (R, V) sort, noise only for candidates) costs ~40 ms at
        256 requests where the general verifier costs ~0.9 s; on GPUs the verifier's sort is cheap.
        """
        if logits.device.type == "cpu":
            return sample_nucleus(logits, [r.params.temperature for r in reqs], [r.params.top_p for r in reqs],
                                  [r.generator for r in reqs])
        return verify(build_verify_input(logits, reqs, [[] for _ in reqs], None, [0] * len(reqs))).next_token

    def _prompt_features(self, reqs: list[Request], starts: list[int], cached: list[torch.Tensor | None],
                         out: ForwardOutput) -> list[torch.Tensor | None]:
        """Each prompt's drafter features (len(prompt), F): the prefix cache's, then the computed ones."""
        if not self.hidden_layers or self.drafter is None:
            return [None] * len(reqs)
        feats = torch.cat([out.hidden_states[i] for i in self.hidden_layers], dim=-1)  # (T, taps*D)
        result: list[torch.Tensor | None] = []
        offset = 0
        for req, start, pre in zip(reqs, starts, cached):
            n = len(req.prompt_ids) - start
            mine = feats[offset:offset + n]
            result.append(mine if pre is None else torch.cat([pre, mine]))
            offset += n
        return result

    def _feed_drafter(self, reqs: list[Request], chunk_lens: list[int], num_kept: list[int],
                      out: ForwardOutput) -> None:
        if not self.hidden_layers or self.drafter is None:
            return
        feats = torch.cat([out.hidden_states[i] for i in self.hidden_layers], dim=-1)  # (T, taps*D)
        offset = 0
        for req, n_chunk, n_keep in zip(reqs, chunk_lens, num_kept):
            # features of cache positions num_cached .. num_cached + n_keep - 1, in order
            self.drafter.observe(req.request_id, feats[offset:offset + n_keep])  # type: ignore[attr-defined]
            offset += n_chunk

    @torch.inference_mode()
    def rebuild_draft_contexts(self, max_positions: int = 4096, max_seqs: int = 8,
                               batch_tokens: int = MAX_PREFILL_TOKENS) -> int:
        """Hand the drafter the target features of the running requests' cached positions again.

        For a drafter that lost them (a replaced draft worker): a forward over each request's cached
        tokens in a scratch KV pool (the serving cache is left as it is) recomputes the features
        `_feed_drafter` gave it, so drafting resumes on the full context, not on what comes after the
        fault. The work stalls this engine's steps, so it is bounded: up to `max_positions`, the requests
        with the most tokens still to generate first; the others finish target-only (the draft side
        cannot draft them and says so). Returns the number of positions recomputed (0 for a drafter that
        takes no features)."""
        if not self.hidden_layers or self.drafter is None:
            return 0
        live = sorted((r for r in self.running if not r.is_finished and r.num_cached > 0),
                      key=lambda r: len(r.output_ids) - r.params.max_tokens)  # most still to come first
        reqs, total = [], 0
        for r in live:
            if total + r.num_cached <= max_positions:
                reqs.append(r)
                total += r.num_cached
        if not reqs:
            return 0
        groups = _prefill_groups(reqs, [r.num_cached for r in reqs], max_seqs, batch_tokens)
        with self.runner.scratch_cache(max(len(g) for g in groups), max(r.num_cached for r in reqs)) as cache:
            for group in groups:
                cache.num_active = 0
                chunks = [SeqChunk(cache.allocate(), 0, r.token_ids[:r.num_cached], 1) for r in group]
                out = self.runner.forward(chunks, self.hidden_layers)
                lens = [r.num_cached for r in group]
                self._feed_drafter(group, lens, lens, out)
        return sum(r.num_cached for r in reqs)

    def _commit(self, active: list[Request], draft: DraftOutput, lengths: list[int],
                accepted: list[int], next_tokens: list[int]) -> list[RequestOutput]:
        self.tracker.update(lengths, accepted)
        feedback = getattr(self.drafter, "feedback", None)  # drafters that track acceptance per source
        if feedback is not None and any(lengths):
            feedback([r.request_id for r in active], lengths, accepted)
        outputs = []
        for req, d, n_ver, n_acc, tok in zip(active, draft.tokens, lengths, accepted, next_tokens):
            req.num_steps += 1
            req.num_drafted += len(d)
            req.num_verified += n_ver
            req.num_accepted += n_acc
            req.num_cached += 1 + n_acc  # rejected positions are rolled back by not counting them
            self.runner.cache.lengths[req.slot] = req.num_cached
            outputs.append(self._emit(req, d[:n_acc] + [tok]))
        return outputs

    def _emit(self, req: Request, tokens: list[int]) -> RequestOutput:
        kept = append_with_stops(req, tokens, self.eos_ids, self.tokenizer)
        if req.is_finished:
            req.finish_s = time.perf_counter()
        # the whole output only on the last one: a growing copy every step is O(n²) bytes over Ray
        done = req.is_finished
        logprobs = None
        if req.params.logprobs is not None:
            logprobs, req.pending_logprobs = req.pending_logprobs[:len(kept)], []
        return RequestOutput(req.request_id, kept, list(req.output_ids) if done else [], done,
                             req.finish_reason, len(req.prompt_ids), req.num_verified, req.num_accepted, logprobs)

    def _reap_aborted(self) -> list[RequestOutput]:
        outputs = []
        for req in [r for r in self.waiting if r.is_finished]:
            self.waiting.remove(req)
            outputs.append(RequestOutput(req.request_id, [], req.output_ids, True, req.finish_reason,
                                         len(req.prompt_ids), req.num_verified, req.num_accepted))
        outputs += [RequestOutput(r.request_id, [], r.output_ids, True, r.finish_reason,
                                  len(r.prompt_ids), r.num_verified, r.num_accepted)
                    for r in self.running if r.is_finished and r.finish_reason == FinishReason.ABORT]
        self._release_finished()
        return outputs

    def _release_finished(self) -> None:
        for req in [r for r in self.running if r.is_finished]:
            moved = self.runner.cache.free(req.slot)
            last = self.running.pop()
            if moved is not None:
                last.slot = req.slot
                self.running[req.slot] = last
            if self.drafter is not None:
                self.drafter.release(req.request_id)

    # ---- convenience ---------------------------------------------------------------------------
    def generate_bulk(self, prompts: list[list[int]], params: list[SamplingParams],
                      progress: tqdm | None = None) -> list[Request]:
        """`generate` with the longest prompts admitted first, results in input order: requests that
        run together then have similar lengths, so attention (which reads each run of rows up to its
        longest) wastes little. For offline generation, where admission order does not matter."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        done = self.generate([prompts[i] for i in order], [params[i] for i in order], progress)
        out: list[Request | None] = [None] * len(prompts)
        for i, req in zip(order, done):
            out[i] = req
        return out  # type: ignore[return-value]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress: tqdm | None = None) -> list[Request]:
        """Run prompts to completion: up to max_num_seqs at once, in order, each finished one's slot
        refilled from the queue at the next step. `progress` (a tqdm) counts the tokens emitted."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, Request] = {}
        by_id = {}
        while self.has_unfinished():
            for r in self.waiting + self.running:
                by_id[r.request_id] = r
            outputs = self.step()
            if progress is not None:
                progress.update(sum(len(o.new_token_ids) for o in outputs))
            for out in outputs:
                if out.is_finished:
                    done[out.request_id] = by_id[out.request_id]
        return [done[i] for i in ids]
