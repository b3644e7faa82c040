"""The settled state of every key's quota, in one small named Ray actor (`<cluster_name>-quotas`, detached).

Ingress replicas enforce quotas locally (quotas.py) and settle here every `quotas.SYNC_S`: each sends what
its keys used since the last settlement and gets the settled levels back. So a key's quota is shared by all
ingress replicas (within one settlement period of slack per replica), and an ingress replica that restarts
(Serve replaces it, or `serve deploy` changes its config) reads the levels back instead of starting full.
The actor is detached and restarted by Ray if it dies; a restarted board starts every bucket full (its state
is in memory only), which is the one way a key gets a fresh minute early. Without Ray (a plain uvicorn
server in tests) each process keeps its own buckets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from dspark.cluster.ingress.quotas import SYNC_S, Bucket, QuotaBook

log = logging.getLogger(__name__)
NAMESPACE = "dspark"

Limits = dict[str, tuple[float | None, float | None]]


@ray.remote(num_cpus=0, max_restarts=-1)
class QuotaBoard:
    def __init__(self) -> None:
        self.buckets: dict[str, tuple[Bucket | None, Bucket | None]] = {}

    def settle(self, limits: Limits, used: dict[str, list[float]]) -> dict[str, tuple[float | None, float | None,
                                                                                      float]]:
        now = time.time()
        out = {}
        for digest, (rpm, tpm) in limits.items():
            req, tok = self.buckets.get(digest, (None, None))
            if rpm and (req is None or req.per_minute != rpm):
                req = Bucket(rpm, level=min(rpm, req.level) if req else rpm)
            if tpm and (tok is None or tok.per_minute != tpm):
                tok = Bucket(tpm, level=min(tpm, tok.level) if tok else tpm)
            req, tok = (req if rpm else None), (tok if tpm else None)
            spent = used.get(digest, [0.0, 0.0])
            for bucket, amount in ((req, spent[0]), (tok, spent[1])):
                if bucket is not None:
                    bucket.refill(now)
                    bucket.level -= amount
            self.buckets[digest] = (req, tok)
            out[digest] = (req.level if req else None, tok.level if tok else None, now)
        return out


def board_handle(cluster_name: str) -> Any:
    return QuotaBoard.options(name=f"{cluster_name}-quotas", namespace=NAMESPACE, lifetime="detached",
                              get_if_exists=True).remote()


async def settle_forever(book: QuotaBook, cluster_name: str) -> None:
    """The ingress replica's side: settle with the board every SYNC_S, for as long as the event loop runs."""
    board = None
    while True:
        try:
            board = board or board_handle(cluster_name)
            used = book.take_used()
            try:
                levels = await board.settle.remote(book.limits, used)
            except BaseException:
                for digest, (r, t) in used.items():  # not settled: count it again next time
                    pending = book.used.setdefault(digest, [0.0, 0.0])
                    pending[0] += r
                    pending[1] += t
                raise
            book.adopt(levels)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the board restarts; local buckets hold meanwhile
            board = None
            log.info("quota settlement failed (%r); enforcing locally until the next one", exc)
        await asyncio.sleep(SYNC_S)


def start_settling(book: QuotaBook, cluster_name: str) -> asyncio.Task | None:
    """Start `settle_forever` on the running loop when this process is part of a Ray cluster."""
    if not book.is_enabled or not ray.is_initialized():
        return None
    return asyncio.get_running_loop().create_task(settle_forever(book, cluster_name))
