"""The outputs a deployment serves, indexed per tenant for the suffix proposer's "served" source.

A finished request's text (prompt and output) joins its tenant's store; each store keeps the newest
`max_tokens_per_tenant` tokens (oldest evicted) and its own suffix array, rebuilt on a background thread
once enough new text has arrived (a quarter of what is indexed, at least `min_rebuild_tokens`), then
swapped in whole: proposals read whichever index is current and never wait for a build.

Tenants are kept apart on purpose: a request drafts only from its own tenant's served text (the API key
the ingress saw, or "" where the config shares one store), because acceptance timing would otherwise let
one tenant probe another's text. At most `max_tenants` stores are kept; the least recently used goes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from dspark.models.drafters.suffix.index import SuffixIndex

log = logging.getLogger(__name__)


@dataclass
class ServedConfig:
    is_enabled: bool = True
    max_tokens_per_tenant: int = 1_000_000
    max_tenants: int = 64
    min_rebuild_tokens: int = 2048


class _TenantStore:
    def __init__(self) -> None:
        self.docs: deque[np.ndarray] = deque()
        self.num_tokens = 0
        self.num_new = 0  # tokens added since the index was last built
        self.index: SuffixIndex | None = None
        self.is_building = False


class ServedText:
    """Per-tenant stores of served text, each with a suffix index swapped in after background rebuilds."""

    def __init__(self, config: ServedConfig | None = None, background: bool = True) -> None:
        self.config = config or ServedConfig()
        self.background = background  # False: rebuild inline (tests, offline tools)
        self._stores: OrderedDict[str, _TenantStore] = OrderedDict()
        self._lock = threading.Lock()
        self.num_builds = 0

    def add(self, tenant: str, tokens: np.ndarray) -> None:
        """A finished request's tokens join its tenant's store (and may start a rebuild)."""
        if not self.config.is_enabled or len(tokens) < 2:
            return
        with self._lock:
            store = self._stores.get(tenant)
            if store is None:
                store = self._stores[tenant] = _TenantStore()
                while len(self._stores) > self.config.max_tenants:
                    self._stores.popitem(last=False)
            self._stores.move_to_end(tenant)
            doc = np.array(tokens[-self.config.max_tokens_per_tenant:], dtype=np.int32)
            store.docs.append(doc)
            store.num_tokens += len(doc)
            store.num_new += len(doc)
            while store.num_tokens > self.config.max_tokens_per_tenant and len(store.docs) > 1:
                store.num_tokens -= len(store.docs.popleft())
            indexed = store.num_tokens - store.num_new
            due = store.num_new >= max(self.config.min_rebuild_tokens, indexed // 4)
            if not due or store.is_building:
                return
            store.is_building = True
            snapshot = list(store.docs)
            store.num_new = 0
        if self.background:
            threading.Thread(target=self._build, args=(tenant, store, snapshot), name="dspark-served-index",
                             daemon=True).start()
        else:
            self._build(tenant, store, snapshot)

    def _build(self, tenant: str, store: _TenantStore, docs: list[np.ndarray]) -> None:
        try:
            index = SuffixIndex.build(docs)
        except Exception:  # noqa: BLE001 - a failed build keeps the previous index: drafts only get worse
            log.exception("served-text index of tenant %r failed to build", tenant)
            index = store.index
        with self._lock:
            store.index = index
            store.is_building = False
            self.num_builds += 1

    def index_for(self, tenant: str) -> SuffixIndex | None:
        store = self._stores.get(tenant)
        return store.index if store is not None else None

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"num_tenants": len(self._stores), "num_tokens": sum(s.num_tokens for s in self._stores.values()),
                    "num_builds": self.num_builds}
