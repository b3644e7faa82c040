"""A/B arms at the ingress: which arm a request goes to, stickily, and who may override it.

Assignment is a pure function of the user: sha256 of the OpenAI `user` field (or of the session header
when there is no user) mapped to [0, 1) and cut by the arms' cumulative weights, so one user always sees
one arm, across replicas and restarts, and changing the weights moves only the users between the old and
new cut points. Requests with neither field are split by their request id (not sticky, by necessity).
An override header picks an arm by name, honoured for admin keys only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

OVERRIDE_HEADER = "x-dspark-arm"
SESSION_HEADER = "x-session-id"
ARM_HEADER = "x-dspark-arm"  # also on every response: the arm that served it


@dataclass(frozen=True)
class Arm:
    name: str
    weight: float


def validate_arms(arms: list[Arm]) -> list[Arm]:
    if not arms:
        raise ValueError("at least one arm is needed")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}")
    if any(a.weight < 0 for a in arms) or sum(a.weight for a in arms) <= 0:
        raise ValueError("arm weights must be >= 0 and not all 0")
    return arms


def unit_hash(key: str) -> float:
    """A stable value in [0, 1) for `key` (first 8 bytes of its sha256)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def assign_arm(arms: list[Arm], user: str | None, session: str | None, request_id: str) -> str:
    """The arm for this request: sticky per user (else per session), by the arms' weights."""
    key = f"user:{user}" if user else f"session:{session}" if session else f"request:{request_id}"
    x = unit_hash(key) * sum(a.weight for a in arms)
    for arm in arms:
        if x < arm.weight:
            return arm.name
        x -= arm.weight
    return next(a.name for a in reversed(arms) if a.weight > 0)


def chosen_arm(arms: list[Arm], user: str | None, session: str | None, request_id: str,
               override: str | None, is_admin: bool) -> str:
    """`assign_arm`, unless an admin asked for a named arm (an unknown name is the caller's 400)."""
    if override and is_admin:
        if override not in {a.name for a in arms}:
            raise ValueError(f"unknown arm {override!r}; arms: {[a.name for a in arms]}")
        return override
    return assign_arm(arms, user, session, request_id)
