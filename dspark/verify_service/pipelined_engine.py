"""The engine with drafting overlapped: running requests form micro-batches that step in ping-pong.

A step serves ONE micro-batch g: collect g's draft (submitted at the end of g's previous step), schedule,
verify, commit, then submit g's next draft round. With a remote drafter, that draft runs on the draft
worker while this worker verifies the other micro-batch, so neither side idles. Drafts are taken from
each request's committed tokens only, so the output distribution is the same as the sequential
engine's; a request admitted since g's last submission simply has no draft this step (ℓ = 0).

While the draft gate skips drafting and no round is in flight there is nothing to overlap, so a step
serves every micro-batch at once (one full batch through the target, as plain decoding would); ping-pong
resumes as soon as the gate lets a micro-batch draft again.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from dspark.config.engine import EngineConfig
from dspark.models.drafters.base import Drafter, DraftOutput, DraftRequest, SparseQ
from dspark.models.target.loader import TargetModel
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import Request, RequestOutput
from dspark.verify_service.step.draft import no_draft

PUSH_MIN_ROWS = 16  # while not drafting, ship a micro-batch's context once this many feature rows wait


class _LocalRounds:
    """submit/collect over an in-process drafter: drafting happens at submit time."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self._ready: list[DraftOutput] = []

    def submit(self, requests: list[DraftRequest], max_num_tokens: int) -> None:
        self._ready.append(self.drafter.propose(requests, max_num_tokens))

    def collect(self) -> DraftOutput:
        return self._ready.pop(0)


class PipelinedEngine(Engine):
    """`Engine` whose step serves one of `num_micro_batches` micro-batches, drafts submitted ahead."""

    def __init__(self, config: EngineConfig, target: TargetModel | None = None, drafter: Drafter | None = None,
                 num_micro_batches: int = 2) -> None:
        super().__init__(config, target, drafter)
        if num_micro_batches < 1:
            raise ValueError("num_micro_batches must be >= 1")
        self.num_micro_batches = num_micro_batches
        self._turn = 0
        self._in_flight: dict[int, list[str]] = {}  # micro-batch -> request ids of its submitted round
        self._submit_ms: dict[int, float] = {}  # micro-batch -> time its last submit took (local drafting)
        self._merged = False  # the gate refused the last submission: step all micro-batches together
        self._rounds = self._make_rounds()

    def _make_rounds(self) -> object | None:
        if self.drafter is None:
            return None
        return self.drafter if hasattr(self.drafter, "submit") else _LocalRounds(self.drafter)

    def set_drafter(self, drafter: Drafter | None) -> None:
        """Swap the drafter (e.g. re-pairing with another draft worker); only while idle."""
        if self.has_unfinished():
            raise RuntimeError("cannot swap the drafter while requests are running")
        self.drafter = drafter
        self.hidden_layers = tuple(getattr(drafter, "hidden_layers", ()))
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # its blocks hold the old drafter's features
        self._in_flight.clear()
        self._rounds = self._make_rounds()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._reap_aborted()
        group = self._turn
        self._turn = (self._turn + 1) % self.num_micro_batches
        merged = self._merged and not self._in_flight  # no draft to overlap: one round over every micro-batch

        def members() -> list[Request]:
            running = [r for r in self.running if not r.is_finished]
            return running if merged else [r for r in running if r.micro_batch == group]

        source = no_draft if merged else functools.partial(self._collect, group)
        extra_ms = 0.0 if merged else self._submit_ms.pop(group, 0.0)
        self._assign_micro_batches()
        active = members()
        # on the native-attention path the prompts admitted now ride in the round's forward (one pass over the
        # weights, not two: `Engine._fused_admission_step`; at 32 requests a speculating worker admits one or
        # two most steps, as requests end at different steps); else a prefill forward of their own first, and
        # the round takes them in. Lossless as there: what rides depends on arrivals, never on draft tokens.
        boarding = self._boarding() if active and self.waiting and self._can_fuse_admission() else None
        if boarding:
            outputs += self._round_with_riders(active, boarding, source, group, extra_ms)
        else:
            outputs += self._admit()
            active = members()
            if active:
                outputs += self._round(active, source, group, extra_ms)
            elif not merged and group in self._in_flight:  # everyone in it left: drain it, replies in order
                self._collect(group, [])
        self._release_finished()
        self._submit(group, [r for r in self.running if r.micro_batch == group and not r.is_finished])
        self.keepalive(is_idle=False)
        return outputs

    def keepalive(self, is_idle: bool = True) -> None:
        """Called every step and while idle: a remote drafter's link must not sit silent past its timeout;
        idle, the draft side also learns at once which requests finished (their contexts are freed)."""
        rounds: Any = self._rounds
        if hasattr(rounds, "keepalive"):
            rounds.keepalive(flush_released=is_idle)

    def _assign_micro_batches(self) -> None:
        """The requests admitted next join the smallest micro-batches."""
        sizes = [0] * self.num_micro_batches
        for r in self.running:
            sizes[r.micro_batch] += 1
        for req in self.waiting[:max(0, self.config.max_num_seqs - len(self.running))]:
            req.micro_batch = min(range(self.num_micro_batches), key=lambda g: sizes[g])
            sizes[req.micro_batch] += 1

    def _admit(self) -> list[RequestOutput]:
        self._assign_micro_batches()
        return super()._admit()

    def _collect(self, group: int, active: list[Request]) -> DraftOutput:
        ids = self._in_flight.pop(group, None)
        empty = DraftOutput(tokens=[[] for _ in active])
        if ids is None or self._rounds is None:
            return empty
        out: DraftOutput = self._rounds.collect()  # type: ignore[attr-defined]
        index = {rid: i for i, rid in enumerate(ids)}
        rows = [index.get(r.request_id) for r in active]
        probs = None
        if out.probs is not None and out.probs:
            none = SparseQ.point_masses([])  # a request without a draft
            probs = [out.probs[i] if i is not None else none for i in rows]
        return DraftOutput(
            tokens=[out.tokens[i] if i is not None else [] for i in rows],
            probs=probs,
            confidences=None if out.confidences is None else [
                out.confidences[i] if i is not None else [] for i in rows],
            sources=None if out.sources is None else [out.sources[i] if i is not None else "" for i in rows],
            num_proposals=out.num_proposals)

    def _submit(self, group: int, active: list[Request]) -> None:
        gamma = self.config.num_draft_tokens
        if self._rounds is None or gamma == 0 or not active:
            return
        self._merged = not self._gate_allows(len(active))
        reqs = [DraftRequest(r.request_id, r.token_ids, r.params.temperature, r.params.tenant) for r in active]
        if self._merged:
            # not drafting: a remote drafter still gets the context now and then, off the critical path
            # of the round that the gate's next probe will wait for
            rounds: Any = self._rounds
            if getattr(rounds, "can_push", False) and rounds.num_buffered_rows(reqs) >= PUSH_MIN_ROWS:
                rounds.push(reqs)
            return
        t0 = time.perf_counter()
        self._rounds.submit(reqs, gamma)  # type: ignore[attr-defined]
        self._submit_ms[group] = (time.perf_counter() - t0) * 1e3
        self._in_flight[group] = [r.request_id for r in active]
