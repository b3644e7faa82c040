"""Per-key quotas: requests per minute and tokens per minute, as token buckets, with OpenAI's headers.

A key with a quota (serve config `api_key_quotas`, by the key's SHA-256) has two buckets, each holding at
most a minute's worth and refilling continuously at its per-minute rate. A request takes one from the
requests bucket when it is admitted; its tokens (prompt + completion) are taken from the tokens bucket when
it ends, since only then are they known, so the bucket can go below zero (a debt the refill pays back).
A request is refused with 429 while either bucket is empty (requests < 1, tokens <= 0), before its body is
read. Every response to a key with a quota carries the headers OpenAI-compatible clients read:
`x-ratelimit-limit-{requests,tokens}`, `x-ratelimit-remaining-{requests,tokens}`,
`x-ratelimit-reset-{requests,tokens}` (time until the bucket is full again, as "1m30s" / "6s" / "250ms").
Keys without a quota are never counted or limited.

Each ingress replica enforces its buckets locally (no call on the request path) and settles with the
`QuotaBoard` actor (quota_board.py) every `SYNC_S`: that shares a key's quota between ingress replicas and
keeps it across an ingress replica's restart.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

SYNC_S = 0.5


@dataclass
class Bucket:
    """Holds at most `per_minute`, refills at `per_minute / 60` per second; `level` may go below zero."""

    per_minute: float
    level: float = math.nan
    at_s: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if math.isnan(self.level):
            self.level = self.per_minute

    def refill(self, now_s: float) -> None:
        self.level = min(self.per_minute, self.level + (now_s - self.at_s) * self.per_minute / 60.0)
        self.at_s = now_s

    def seconds_to_full(self) -> float:
        return max(0.0, (self.per_minute - self.level) * 60.0 / self.per_minute)

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) * 60.0 / self.per_minute)


def duration_text(seconds: float) -> str:
    """OpenAI's reset format: '1m30s', '6s', '250ms'."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60.0)
    secs_text = f"{secs:.0f}s" if secs >= 1 or not minutes else ""
    return f"{int(minutes)}m{secs_text}" if minutes >= 1 else f"{secs:.0f}s"


@dataclass
class KeyBuckets:
    requests: Bucket | None
    tokens: Bucket | None

    def refill(self, now_s: float) -> None:
        for b in (self.requests, self.tokens):
            if b is not None:
                b.refill(now_s)

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, b in (("requests", self.requests), ("tokens", self.tokens)):
            if b is not None:
                out[f"x-ratelimit-limit-{name}"] = str(int(b.per_minute))
                out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(b.level)))
                out[f"x-ratelimit-reset-{name}"] = duration_text(b.seconds_to_full())
        return out


@dataclass
class QuotaDecision:
    is_allowed: bool
    headers: dict[str, str]
    retry_after_s: int = 0
    reason: str = ""


class QuotaBook:
    """The buckets of every key with a quota, by key digest. `used` accumulates what this replica took since
    its last settlement with the board."""

    def __init__(self, quotas: dict[str, tuple[float | None, float | None]]) -> None:
        self.limits = {d.lower(): q for d, q in quotas.items()}
        self.buckets: dict[str, KeyBuckets] = {
            d: KeyBuckets(Bucket(r) if r else None, Bucket(t) if t else None) for d, (r, t) in self.limits.items()}
        self.used: dict[str, list[float]] = {}  # digest -> [requests, tokens] since the last sync

    @property
    def is_enabled(self) -> bool:
        return bool(self.buckets)

    def check(self, digest: str | None) -> QuotaDecision | None:
        """None for a key without a quota; else whether one more request may start now (and takes it)."""
        kb = self.buckets.get(digest or "")
        if kb is None:
            return None
        now = time.time()
        kb.refill(now)
        waits = []
        if kb.requests is not None and kb.requests.level < 1.0:
            waits.append(("requests per minute", kb.requests.seconds_until(1.0)))
        if kb.tokens is not None and kb.tokens.level <= 0.0:
            waits.append(("tokens per minute", kb.tokens.seconds_until(1.0)))
        if waits:
            reason, wait = max(waits, key=lambda w: w[1])
            return QuotaDecision(False, kb.headers(), max(1, math.ceil(wait)), reason)
        if kb.requests is not None:
            kb.requests.level -= 1.0
        self.used.setdefault(digest or "", [0.0, 0.0])[0] += 1.0
        return QuotaDecision(True, kb.headers())

    def charge_tokens(self, digest: str | None, num_tokens: int) -> None:
        kb = self.buckets.get(digest or "")
        if kb is None or kb.tokens is None or num_tokens <= 0:
            return
        kb.refill(time.time())
        kb.tokens.level -= num_tokens
        self.used.setdefault(digest or "", [0.0, 0.0])[1] += num_tokens

    def take_used(self) -> dict[str, list[float]]:
        used, self.used = self.used, {}
        return used

    def adopt(self, levels: dict[str, tuple[float | None, float | None, float]]) -> None:
        """The board's settled levels (requests, tokens, at time), minus what was used here since they were
        read (`pending`, passed by the caller through `take_used` ordering)."""
        for digest, (requests, tokens, at_s) in levels.items():
            kb = self.buckets.get(digest)
            if kb is None:
                continue
            pending = self.used.get(digest, [0.0, 0.0])
            if kb.requests is not None and requests is not None:
                kb.requests.level, kb.requests.at_s = requests - pending[0], at_s
            if kb.tokens is not None and tokens is not None:
                kb.tokens.level, kb.tokens.at_s = tokens - pending[1], at_s
