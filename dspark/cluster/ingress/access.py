"""API keys: bearer tokens on every route, admin keys for the operator routes.

Keys come from the serve config as SHA-256 hex digests (`api_key_sha256`, `admin_api_key_sha256`) and/or
from the environment as plain comma-separated keys (`DSPARK_API_KEYS`, `DSPARK_ADMIN_API_KEYS`), which
are hashed on load. A presented key is hashed and compared with every stored digest by
`hmac.compare_digest` (constant time, and no early exit on the first match). No key is ever logged:
log lines name a key by the first 8 hex digits of its digest. With no key configured at all the API is
open (a warning says so at start), which is what `make serve` on a laptop wants.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

Access = Literal["user", "admin"]


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _env_digests(var: str) -> list[str]:
    return [key_digest(k.strip()) for k in os.environ.get(var, "").split(",") if k.strip()]


@dataclass
class KeyRing:
    """Digests of the accepted keys; admin keys are also user keys."""

    user_digests: list[str] = field(default_factory=list)
    admin_digests: list[str] = field(default_factory=list)

    @staticmethod
    def from_config(user: list[str], admin: list[str]) -> KeyRing:
        ring = KeyRing([d.lower() for d in user] + _env_digests("DSPARK_API_KEYS"),
                       [d.lower() for d in admin] + _env_digests("DSPARK_ADMIN_API_KEYS"))
        if not ring.is_enabled:
            log.warning("no API keys configured: every route is open (set DSPARK_API_KEYS or api_key_sha256)")
        return ring

    @property
    def is_enabled(self) -> bool:
        return bool(self.user_digests or self.admin_digests)

    def access_of(self, authorization: str | None) -> Access | None:
        """'admin', 'user', or None (no or unknown key) for an `Authorization: Bearer <key>` header."""
        if not self.is_enabled:
            return "admin"
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        digest = key_digest(authorization[7:].strip())
        is_admin = _matches_any(digest, self.admin_digests)
        is_user = _matches_any(digest, self.user_digests)
        return "admin" if is_admin else "user" if is_user else None


def presented_digest(authorization: str | None) -> str | None:
    """The digest of the bearer key in an `Authorization` header (what quotas are keyed by), or None."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    return key_digest(authorization[7:].strip())


def _matches_any(digest: str, digests: list[str]) -> bool:
    found = False
    for d in digests:  # no early exit: the time does not tell which (or whether a) digest matched
        found |= hmac.compare_digest(digest, d)
    return found
