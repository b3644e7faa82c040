"""The speculative-decoding engine: continuous batching over one target runner and one drafter.

`Engine.step` admits waiting requests (prefill), then runs one round whose phases live in `step/`, one
module each: draft (the drafter proposes up to γ tokens per request), schedule (the prefix scheduler picks
ℓ_r per request from survival estimates and the SPS table), verify (ONE flattened target forward over all
requests' 1 + ℓ_r tokens, then lossless acceptance), commit (append accepted tokens, roll back the cache by
length, apply stop conditions); then the drafter is fed the target features of what stayed cached.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from dspark.config.engine import EngineConfig, resolve_dtype
from dspark.models.drafters.base import Drafter, DraftOutput, declines_features, features_optional
from dspark.models.drafters.registry import make_drafter
from dspark.models.target.generic_runner import GenericRunner
from dspark.models.target.layer import ForwardOutput, SeqChunk
from dspark.models.target.loader import TargetModel, load_target
from dspark.models.target.profiles import load_sps
from dspark.models.target.runner import TargetRunner
from dspark.spec.draft_gate import DraftGate
from dspark.spec.schedulers import Scheduler, make_scheduler
from dspark.spec.survival import AcceptanceTracker
from dspark.spec.token_cost import TokenCost
from dspark.verify_service.prefix_cache import BLOCK as PREFIX_BLOCK
from dspark.verify_service.prefix_cache import PrefixCache
from dspark.verify_service.request import (
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    StepStats,
    validate_request,
)
from dspark.verify_service.step import draft as draft_phase
from dspark.verify_service.step.commit import commit, emit
from dspark.verify_service.step.feed import feed_drafter, prompt_features
from dspark.verify_service.step.prefill import MAX_PREFILL_TOKENS, prefill_groups
from dspark.verify_service.step.schedule import schedule
from dspark.verify_service.step.verify import note_logprobs, sample_plain, verify_round

# what a round drafts from: the requests in, their drafts out (`step/draft.py`, a pipelined engine's collect)
DraftSource = Callable[[list[Request]], DraftOutput]

log = logging.getLogger(__name__)



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
    drift from target-only decoding in that dtype (models/target/row_invariance.py)."""
    from dspark.models.target.row_invariance import is_row_invariant

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
        self.sps = load_sps(config.sps_profile, self.target) if config.scheduler != "fixed" else None
        self.tracker = AcceptanceTracker(max(1, config.num_draft_tokens))
        self.gate = DraftGate() if config.draft_gate and self.sps is not None else None
        self.token_cost = TokenCost() if config.measured_token_cost and self.sps is not None else None
        self._last_round: tuple[float, float] | None = None  # perf_counter start and end of the last round
        self._forgone: set[str] = set()  # running requests whose drafter features are forgone (_feature_layers)
        self._round_layers: tuple[int, ...] = self.hidden_layers  # the layers the last round tapped
        self._prefill_ms = 0.0  # admission (prefill) time since the last round, kept out of the gate's O
        self._rider_logits: torch.Tensor | None = None  # the riders' logits of the last round (see _round)
        self._rider_hidden: ForwardOutput | None = None  # and their hidden states, where the drafter taps them
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

    def set_scheduler(self, scheduler: Scheduler) -> None:
        """Schedule the next rounds with `scheduler` (a verify worker's central capacity, say)."""
        self.scheduler = scheduler

    def set_draft_gate(self, gate: DraftGate | None) -> None:
        """Gate drafting with `gate` from the next round on (None: always draft)."""
        self.gate = gate

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill), then one draft-schedule-verify-commit round.

        On the native-attention path the prompts admitted this step ride in the same forward as the running
        requests' tokens and drafts (`_fused_admission_step`): one pass over the weights, not two."""
        outputs = self._reap_aborted()
        active = [r for r in self.running if not r.is_finished]
        if active and self.waiting and self._can_fuse_admission():
            outputs += self._fused_admission_step(active)
            self._release_finished()
            return outputs
        outputs += self._admit()
        active = [r for r in self.running if not r.is_finished]
        if active:
            outputs += self._round(active, self._draft)
        self._release_finished()
        return outputs

    def _draft(self, active: list[Request]) -> DraftOutput:
        return draft_phase.propose(self.drafter, self.gate, active, self.config.num_draft_tokens)

    def _draft_beside_prompts(self, active: list[Request]) -> DraftOutput:
        """A round that prefills prompts drafts whatever the gate says. The gate compares rounds without prompts,
        and beside a prompt's hundreds of tokens a draft and its verified tokens cost a small share of the
        forward (the scheduler prices what they add to it, `SPSTable.with_riders`): a round at batch 30 with two
        prompts took ~100 ms where one without took ~60 ms (SmolLM2 bf16, 1 thread, AMX Xeon). Lossless: whether a
        round prefills depends on arrivals, never on draft tokens."""
        return draft_phase.propose(self.drafter, None, active, self.config.num_draft_tokens)

    def _gate_allows(self, batch_size: int) -> bool:
        return draft_phase.gate_allows(self.gate, batch_size)

    def _round(self, active: list[Request], draft_source: DraftSource, micro_batch: int = 0,
               extra_draft_ms: float = 0.0, riders: list[SeqChunk] | None = None) -> list[RequestOutput]:
        """draft (from `draft_source`) → schedule → verify → commit → feed the drafter, for `active`, timed
        into `self.stats`.

        `extra_draft_ms`: drafting time this round already paid outside `draft_source` (a pipelined
        engine drafts locally at submit time), for the draft gate's cost estimate.
        `riders`: prompt chunks computed in the verify forward, ahead of the round's own (their logits are
        left in `self._rider_logits`).
        """
        start_s = time.time()
        t0 = time.perf_counter()
        self._note_gap(t0)
        draft = draft_source(active)
        t1 = time.perf_counter()
        # the profile's row for a step of this many requests (`SPSTable.for_requests`): a batched step's shape
        sps = self.sps.for_requests(len(active)) if self.sps is not None else None
        if riders and sps is not None:  # a verified draft at what it adds beside the prompts (`with_riders`)
            sps = sps.with_riders(sum(len(c.token_ids) for c in riders), len(active))
        elif sps is not None and self.token_cost is not None:  # one more verified token at its measured cost
            sps = self.token_cost.table(len(active), sps)
        lengths = schedule(active, draft, self.scheduler, self.tracker, sps)
        t2 = time.perf_counter()
        layers = self._round_layers = self._feature_layers()
        verified = verify_round(self.runner, active, draft, lengths, layers, riders)
        self._rider_logits, self._rider_hidden = verified.rider_logits, verified.rider_out
        t3 = time.perf_counter()
        outputs = commit(active, draft, lengths, verified.num_accepted, verified.next_token, self.runner.cache,
                         self.tracker, self.drafter, self.eos_ids, self.tokenizer)
        t4 = time.perf_counter()
        # the drafter sees target features of exactly the tokens that stay in the cache
        feed_drafter(self.drafter, layers, active, [n + 1 for n in lengths],
                     [n + 1 for n in verified.num_accepted], verified.out)
        # the target side's time of the round: its forward and acceptance, and handing the drafter its features
        verify_ms = ((t3 - t2) + (time.perf_counter() - t4)) * 1e3
        self._record_round(active, draft, lengths, verified.num_accepted, t0, (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                           verify_ms, micro_batch, extra_draft_ms, start_s, with_riders=bool(riders))
        return outputs

    def _feature_layers(self) -> tuple[int, ...]:
        """The target layers this round taps for the drafter: none once every running request's features are
        forgone. Where the draft gate has measured drafting not to pay at the current batch size, a drafter
        that can go without features (`FeaturesOptional`: the hybrid, from its cheap sources) forgoes them for
        every running request, for the rest of its life: its DSpark context would have a gap. Under such a load
        they cost every step (the taps, the copy, DSpark's projection of each row) and bought nothing
        (batch 32 on a 2-core AMX Xeon: the hybrid 2 % behind target-only, verifying no draft token). So does
        each request the drafter itself declines (`wants_features`: the hybrid, where DSpark's measured worth
        does not pay for its features). Lossless: it depends on the batch size, arrivals and past rounds'
        timings and verdicts, never on the tokens being verified."""
        if not self.hidden_layers or not features_optional(self.drafter):
            return self.hidden_layers
        running = [r for r in self.running if not r.is_finished]
        shut = self.gate is not None and self.gate.is_shut(len(running))
        for req in running:  # and each request the drafter itself no longer wants features for (`wants_features`)
            if req.request_id not in self._forgone and (shut or declines_features(self.drafter, req.request_id)):
                self._forgo(req)
        return self.hidden_layers if any(r.request_id not in self._forgone for r in running) else ()

    def _forgo(self, req: Request) -> None:
        """No more drafter features for `req` (a `FeaturesOptional` drafter drafts it without them)."""
        if req.request_id not in self._forgone and features_optional(self.drafter):
            self._forgone.add(req.request_id)
            self.drafter.forgo_features(req.request_id)

    def _note_gap(self, t0: float) -> None:
        """The draft gate's overhead O: the time between the last round and this one, minus prefill of
        newly admitted requests (paid whether or not steps draft); an idle wait counts at most one round."""
        if self.gate is not None and self._last_round is not None:
            last_start, last_end = self._last_round
            gap_ms = (t0 - last_end) * 1e3 - self._prefill_ms
            self.gate.note_overhead(min(gap_ms, (last_end - last_start) * 1e3))
        self._prefill_ms = 0.0

    def _record_round(self, active: list[Request], draft: DraftOutput, lengths: list[int], accepted: list[int],
                      t0: float, draft_ms: float, schedule_ms: float, verify_ms: float, micro_batch: int,
                      extra_draft_ms: float, start_s: float, with_riders: bool = False) -> None:
        # the gate learns from the round's measured time, drafting on the critical path included; not from a
        # round that also prefilled prompts (its time says little about drafting or not)
        if self.token_cost is not None and not with_riders:
            self.token_cost.record(len(active), sum(lengths), verify_ms, self.sps)  # type: ignore[arg-type]
        if self.gate is not None and not with_riders:
            round_ms = (time.perf_counter() - t0) * 1e3 + extra_draft_ms
            if any(draft.tokens):
                self.gate.record(len(active), sum(lengths), sum(accepted), round_ms, verify_ms,
                                 self.sps.for_requests(len(active)),  # type: ignore[union-attr]
                                 draft_ms=draft_ms + schedule_ms + extra_draft_ms)
            else:
                self.gate.record_plain(len(active), round_ms)
        self.stats.append(StepStats(len(active), sum(lengths) + len(active), lengths, accepted, draft_ms,
                                    schedule_ms, verify_ms, draft.confidences, micro_batch, start_s, time.time(),
                                    draft.sources, draft.num_proposals))
        self.num_steps += 1
        keep = self.config.max_step_stats
        if keep is not None and len(self.stats) >= 2 * keep:  # amortised: trim once per `keep` steps
            del self.stats[:-keep]
        self._last_round = (t0, time.perf_counter())

    # ---- prefill -------------------------------------------------------------------------------
    def _can_fuse_admission(self) -> bool:
        """Attention that takes any mix of chunk lengths per token (the native path, fp32 or bf16)."""
        return self.runner.native_attention

    def _fused_admission_step(self, active: list[Request]) -> list[RequestOutput]:
        """Admit what fits in one prefill group and run `active`'s round (drafts included) in ONE forward.
        Over HTTP at C = 32 a step was half prefill of arriving requests (py-spy, `docs/results/serve` run
        21); as separate forwards each read all weights and paid the per-forward work. With continuous
        batching at batch 8 a separate prefill forward cost ~85 ms where riding in a round costs a few ms
        more than the round (SmolLM2 bf16, 2-core AMX Xeon). New requests get their first token here and
        their first drafts at the next step; what any request samples is unchanged (`sample_plain` per
        request, its own generator; each token's logits do not depend on what else the forward carries)."""
        group = self._boarding()
        if group is None:
            outputs = self._admit()  # a long prompt: its own forward (SDPA), as without fusing
            return outputs + self._round([r for r in self.running if not r.is_finished], self._draft)
        if not group:
            return self._round(active, self._draft)
        return self._round_with_riders(active, group, self._draft_beside_prompts)

    def _boarding(self) -> list[Request] | None:
        """The waiting requests that ride in this step's round: one prefill group ([]: no room); None when a
        prompt of it is too long for the native attention (they get a forward of their own)."""
        free = self.config.max_num_seqs - len(self.running)
        group = prefill_groups(self.waiting[:free])[0] if free > 0 else []
        if group and not self.runner.takes_native_attention([SeqChunk(0, 0, r.prompt_ids, 1) for r in group]):
            return None
        return group

    def _round_with_riders(self, active: list[Request], group: list[Request], draft_source: DraftSource,
                           micro_batch: int = 0, extra_draft_ms: float = 0.0) -> list[RequestOutput]:
        """`group` (from `_boarding`) admitted, its prompts computed in `active`'s round: their first tokens,
        then the round's outputs."""
        t0 = time.perf_counter()
        self.waiting = self.waiting[len(group):]
        for req in group:
            req.slot = self.runner.cache.allocate()
            self.running.append(req)
        start, cached_feats = self._cached_prefixes(group)
        riders = [SeqChunk(r.slot, s, r.prompt_ids[s:], 1) for r, s in zip(group, start)]
        # admission's work (slots, prefix-cache lookups) is paid with or without drafts: not the gate's overhead O
        self._prefill_ms += (time.perf_counter() - t0) * 1e3
        outputs = self._round(active, draft_source, micro_batch, extra_draft_ms, riders=riders)
        t0 = time.perf_counter()
        logits, rider_hidden = self._rider_logits, self._rider_hidden
        self._rider_logits = self._rider_hidden = None
        feats = (prompt_features(self.drafter, self.hidden_layers, group, start, cached_feats, rider_hidden)
                 if rider_hidden is not None and self._round_layers else [None] * len(group))
        self._take_prompt_features(group, feats)
        tokens = sample_plain(group, logits)
        note_logprobs(group, logits, [[i] for i in range(len(group))], [[t] for t in tokens])
        first = self._first_tokens(group, tokens)
        self._prefill_ms += (time.perf_counter() - t0) * 1e3
        return first + outputs

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
        starts, feats_before = self._cached_prefixes(new)
        start = {r.request_id: s for r, s in zip(new, starts)}
        cached_feats = {r.request_id: f for r, f in zip(new, feats_before)}
        first: list[int] = []
        for group in prefill_groups(new, [len(r.prompt_ids) - start[r.request_id] for r in new]):
            out = self.runner.forward([SeqChunk(r.slot, start[r.request_id], r.prompt_ids[start[r.request_id]:], 1)
                                       for r in group], self.hidden_layers)
            feats = prompt_features(self.drafter, self.hidden_layers, group, [start[r.request_id] for r in group],
                                    [cached_feats[r.request_id] for r in group], out)
            self._take_prompt_features(group, feats)
            tokens = sample_plain(group, out.logits)
            note_logprobs(group, out.logits, [[i] for i in range(len(group))], [[t] for t in tokens])
            first += tokens
        outputs = self._first_tokens(new, first)
        self._prefill_ms += (time.perf_counter() - t0) * 1e3
        return outputs

    def _cached_prefixes(self, reqs: list[Request]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each prompt's blocks seen before, copied from the prefix cache into its slot: where its computed part
        starts, and the drafter features the blocks kept. Blocks kept without features (stored while the
        engine forwent them) serve a drafter that can go without: the request forgoes its features (DSpark's
        context would lack the prefix); a drafter that needs features matches only blocks that kept them."""
        if self.prefix_cache is None:
            return [0] * len(reqs), [None] * len(reqs)
        need_feats = bool(self.hidden_layers) and not features_optional(self.drafter)
        starts: list[int] = []
        feats: list[torch.Tensor | None] = []
        for req in reqs:
            hit = self.prefix_cache.match(req.prompt_ids, need_feats)
            f = PrefixCache.load(hit, self.runner.cache, req.slot)
            if hit and f is None and self.hidden_layers:
                self._forgo(req)
            starts.append(len(hit) * PREFIX_BLOCK)
            feats.append(f)
        return starts, feats

    def _take_prompt_features(self, reqs: list[Request], feats: list[torch.Tensor | None]) -> None:
        """Prefilled prompts: the drafter observes each one's features and the prefix cache keeps its blocks
        (with the features where they cover the whole prompt: a prompt whose cached part had none has only
        its computed part's)."""
        for req, f in zip(reqs, feats):
            whole = f if f is not None and f.shape[0] == len(req.prompt_ids) else None
            if declines_features(self.drafter, req.request_id):
                self._forgo(req)
            if self.drafter is not None and whole is not None and req.request_id not in self._forgone:
                self.drafter.observe(req.request_id, whole)  # type: ignore[attr-defined]
            if self.prefix_cache is not None:
                self.prefix_cache.store(req.prompt_ids, self.runner.cache, req.slot, whole)

    def _first_tokens(self, reqs: list[Request], tokens: list[int]) -> list[RequestOutput]:
        """Prefilled requests: their whole prompt is cached now; emit each one's first token."""
        now = time.perf_counter()
        outputs = []
        for req, tok in zip(reqs, tokens):
            req.num_cached = len(req.prompt_ids)
            self.runner.cache.lengths[req.slot] = req.num_cached
            req.first_token_s = now
            outputs.append(emit(req, [tok], self.eos_ids, self.tokenizer))
        return outputs

    @torch.inference_mode()
    def rebuild_draft_contexts(self, max_positions: int = 4096, max_seqs: int = 8,
                               batch_tokens: int = MAX_PREFILL_TOKENS) -> int:
        """Hand the drafter the target features of the running requests' cached positions again.

        For a drafter that lost them (a replaced draft worker): a forward over each request's cached
        tokens in a scratch KV pool (the serving cache is left as it is) recomputes the features
        `feed_drafter` gave it, so drafting resumes on the full context, not on what comes after the
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
        groups = prefill_groups(reqs, [r.num_cached for r in reqs], max_seqs, batch_tokens)
        with self.runner.scratch_cache(max(len(g) for g in groups), max(r.num_cached for r in reqs)) as cache:
            for group in groups:
                cache.num_active = 0
                chunks = [SeqChunk(cache.allocate(), 0, r.token_ids[:r.num_cached], 1) for r in group]
                out = self.runner.forward(chunks, self.hidden_layers)
                lens = [r.num_cached for r in group]
                feed_drafter(self.drafter, self.hidden_layers, group, lens, lens, out)
        return sum(r.num_cached for r in reqs)

    def _reap_aborted(self) -> list[RequestOutput]:
        outputs = []
        for req in [r for r in self.waiting if r.is_finished]:
            self.waiting.remove(req)
            outputs.append(RequestOutput(req.request_id, [], req.output_ids, True, req.finish_reason,
                                         len(req.prompt_ids), req.num_verified, req.num_accepted))
        outputs += [RequestOutput(r.request_id, [], r.output_ids, True, r.finish_reason,
                                  len(r.prompt_ids), r.num_verified, r.num_accepted,
                                  num_steps=r.num_steps + bool(r.output_ids))
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
            self._forgone.discard(req.request_id)

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
                 progress: tqdm | None = None,
                 on_step: Callable[[list[RequestOutput]], None] | None = None) -> list[Request]:
        """Run prompts to completion: up to max_num_seqs at once, in order, each finished one's slot
        refilled from the queue at the next step. `progress` (a tqdm) counts the tokens emitted; `on_step`
        sees each step's outputs (with the engine's queues as the step left them)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, Request] = {}
        by_id = {}
        while self.has_unfinished():
            for r in self.waiting + self.running:
                by_id[r.request_id] = r
            outputs = self.step()
            if on_step is not None:
                on_step(outputs)
            if progress is not None:
                progress.update(sum(len(o.new_token_ids) for o in outputs))
            for out in outputs:
                if out.is_finished:
                    done[out.request_id] = by_id[out.request_id]
        return [done[i] for i in ids]
