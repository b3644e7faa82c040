"""Draft: up to γ tokens per request from the drafter, unless the draft gate says drafting costs more than
it returns at this batch size."""

from __future__ import annotations

from dspark.models.drafters.base import Drafter, DraftOutput, DraftRequest
from dspark.spec.draft_gate import DraftGate
from dspark.verify_service.request import Request


def no_draft(active: list[Request]) -> DraftOutput:
    """A round without drafts: every request verifies only its next token (a plain target step)."""
    return DraftOutput(tokens=[[] for _ in active])


def gate_allows(gate: DraftGate | None, batch_size: int) -> bool:
    return gate is None or gate.should_draft(batch_size)


def propose(drafter: Drafter | None, gate: DraftGate | None, active: list[Request], gamma: int) -> DraftOutput:
    """The drafter's proposals for `active` (index r matches), or none when there is nothing to draft with."""
    if drafter is None or gamma == 0 or not gate_allows(gate, len(active)):
        return no_draft(active)
    reqs = [DraftRequest(r.request_id, r.token_ids, r.params.temperature, r.params.tenant) for r in active]
    return drafter.propose(reqs, gamma)
