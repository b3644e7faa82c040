"""Which verify and draft replicas exist, and who drafts for whom (no Ray).

Replicas of the Serve pools announce themselves with a heartbeat every few seconds; one that stops
(killed, scaled down, its node gone) drops out after `ttl_s`. All of it is soft state: a restarted
SchedulerActor knows every live replica again after one heartbeat period. Pairing is M:N: a verify
replica gets the live draft replica with the fewest verify partners, so one draft replica may serve
several verify replicas. When the draft pool grows (or a draft replica drains), `rebalance` moves verify
replicas one at a time from the most loaded (or draining) draft replica to the least loaded one, so a new
draft replica takes its share of the drafting, which is what lets the draft pool scale on its own signal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

POOLS = ("verify", "draft")


@dataclass
class Member:
    replica_id: str
    pool: str
    last_seen_s: float
    info: dict[str, Any] = field(default_factory=dict)
    is_draining: bool = False


class Registry:
    def __init__(self, ttl_s: float = 15.0, partner_stale_s: float = 5.0, started_s: float | None = None) -> None:
        self.ttl_s, self.partner_stale_s = ttl_s, partner_stale_s
        self.started_s = time.time() if started_s is None else started_s
        self.members: dict[str, Member] = {}
        self.partner: dict[str, str] = {}  # verify replica -> its draft replica

    def heartbeat(self, pool: str, replica_id: str, info: dict[str, Any] | None = None,
                  is_draining: bool = False, now_s: float | None = None) -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        now_s = time.time() if now_s is None else now_s
        m = self.members.get(replica_id)
        if m is None:
            self.members[replica_id] = Member(replica_id, pool, now_s, dict(info or {}), is_draining)
        else:
            m.last_seen_s, m.is_draining = now_s, is_draining
            if info:
                m.info.update(info)
        partner = (info or {}).get("draft_partner")
        if pool == "verify" and partner:
            self.partner[replica_id] = partner

    def leave(self, replica_id: str) -> None:
        self.members.pop(replica_id, None)
        self.partner.pop(replica_id, None)

    def live(self, pool: str, now_s: float | None = None, include_draining: bool = False) -> list[str]:
        now_s = time.time() if now_s is None else now_s
        for rid in [r for r, m in self.members.items() if now_s - m.last_seen_s > self.ttl_s]:
            self.leave(rid)
        return sorted(r for r, m in self.members.items()
                      if m.pool == pool and (include_draining or not m.is_draining))

    def assign_draft(self, verify_id: str, exclude: tuple[str, ...] = (), max_partners: int = 1,
                     now_s: float | None = None) -> str | None:
        """The live draft replica with the fewest verify partners, below `max_partners` (not one of
        `exclude`, e.g. one that just failed); None when every one is taken."""
        now_s = time.time() if now_s is None else now_s
        drafts = [d for d in self.live("draft", now_s) if d not in exclude]
        # a verify replica silent for a few heartbeats is dead: its draft partner is free again
        counts = self._partner_counts(drafts, now_s, skip=verify_id)
        free = [d for d in drafts if counts[d] < max_partners]
        if not free:
            self.partner.pop(verify_id, None)
            return None
        best = min(free, key=lambda d: (counts[d], d))
        self.partner[verify_id] = best
        return best

    def _partner_counts(self, drafts: list[str], now_s: float, skip: str | None = None) -> dict[str, int]:
        counts = {d: 0 for d in drafts}
        for v, d in self.partner.items():
            m = self.members.get(v)
            if d in counts and v != skip and m is not None and now_s - m.last_seen_s <= self.partner_stale_s:
                counts[d] += 1
        return counts

    def rebalance(self, verify_id: str, max_partners: int = 1, now_s: float | None = None) -> str | None:
        """A draft replica `verify_id` should move to, or None to stay. It moves when its partner drains or
        is gone (left, or silent for `ttl_s`: scaled away while the link has not failed yet, because an idle
        verify replica only notices at its next send), or when its partner carries at least two more
        verify replicas than the least loaded live draft replica and it is the last (by id) of its
        partner's verify replicas, so one moves per pass."""
        now_s = time.time() if now_s is None else now_s
        current = self.partner.get(verify_id)
        if current is None:
            return None  # unpaired: assign_draft's business
        drafts = self.live("draft", now_s)  # not draining; drops members silent for ttl_s
        counts = self._partner_counts(drafts, now_s)
        targets = [d for d in drafts if d != current and counts[d] < max_partners]
        if not targets:
            return None
        best = min(targets, key=lambda d: (counts[d], d))
        if current not in self.members:
            if now_s - self.started_s < self.ttl_s:
                return None  # a restarted scheduler has not heard from every live replica yet
            self.partner[verify_id] = best
            return best
        draining = self.members[current].is_draining
        mine = sorted(v for v, d in self.partner.items() if d == current and v in self.members)
        if draining or (counts.get(current, 0) - counts[best] >= 2 and mine and mine[-1] == verify_id):
            self.partner[verify_id] = best
            return best
        return None

    def num_unpaired(self, now_s: float | None = None) -> int:
        """Live verify replicas without a live draft partner."""
        drafts = set(self.live("draft", now_s))
        return sum(1 for v in self.live("verify", now_s) if self.partner.get(v) not in drafts)

    def snapshot(self, now_s: float | None = None) -> dict[str, Any]:
        now_s = time.time() if now_s is None else now_s
        return {pool: {r: {**self.members[r].info, "age_s": round(now_s - self.members[r].last_seen_s, 2),
                           "is_draining": self.members[r].is_draining,
                           **({"draft_partner": self.partner[r]} if r in self.partner else {})}
                       for r in self.live(pool, now_s, include_draining=True)} for pool in POOLS}
