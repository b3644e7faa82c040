"""The suffix proposer's two indexes: a global suffix array over the target's own text, and one request's text.

Global (`SuffixIndex`): documents (token id arrays) concatenated with -1 between them, and `sa`, the text
positions sorted by the `depth` tokens that follow each one. Built by prefix doubling in numpy (⌈log2
depth⌉ stable sorts); 8 bytes per token kept (int32 text + int32 positions), so 10M tokens take 80 MB;
persisted under the cache keyed by the text's hash, so a replica loads it in well under a
second instead of sorting again. Read-only once built: one index serves every request of a replica.

Per request (`RequestText`): the request's prompt and output so far, appended as the request grows (only
the new tail is copied), walked by the same rule (`request_walk`).

Both return a `Walk`: the proposed tokens and, per token, what the calibration of its survival reads:
the conditional frequency of the token after its context, that context's support (how many times it
occurred) and its length.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.kernels import suffix_native
from dspark.models.drafters.base import SparseQ

log = logging.getLogger(__name__)

SEPARATOR = -1
_NO_INDEX = (0, 0, 0, 0)
DEFAULT_DEPTH = 32  # tokens a suffix is sorted by: context (≤ 8) + walk (≤ 16) stays within it


@dataclass
class WalkParams:
    """How a walk matches and how far it goes."""

    min_ctx: int = 2  # the global index: context suffixes of max_ctx .. min_ctx tokens
    max_ctx: int = 8
    # the request's own text: its longest earlier context of request_max_ctx .. request_min_ctx tokens. Prompt
    # lookup's 3 .. 1 could not tell a 3-token echo from a 16-token one, and its survival read them alike: on
    # 160 eval prompts a set at T = 0 the request source's ECE was 3.2 % at 3, 2.4 % at 8, 2.0 % at 16 and
    # 2.2 % at 32 (noise floor 1.2 %; docs/results/suffix/README.md, session 41)
    request_min_ctx: int = 1
    request_max_ctx: int = 16
    min_path_prob: float = 0.1
    num_samples: int = 64  # strided samples of a large run (see suffix_kernels.c; at most 64)
    max_occurrences: int = 256  # per-request walk: the most recent occurrences looked at
    max_q: int = 16  # sampled walks (T > 0): q keeps a context's this many most frequent continuations


@dataclass(slots=True)  # slots: a round makes one per request, and their fields are read on every round
class Walk:
    """One proposal: k tokens and, per token, its conditional frequency, support and context length, and
    its survival c_k read from the calibration table the walk was given (the raw frequency without one).
    A sampled walk (`sample_batch`) also carries q per step (`q`: ids and probabilities, k × max_q, unused slots
    -1 / 0), and its `freq` is q's largest probability (what the calibration reads; never the drawn token's)."""

    tokens: list[int]
    freq: list[float]
    count: list[int]
    match: list[int]
    conf: list[float]
    q: SparseQ | None = None

    @staticmethod
    def empty() -> Walk:
        return Walk([], [], [], [], [])


class _Out:
    """Output buffers of one walk (reused: a walk writes at most max_tokens entries)."""

    def __init__(self, max_tokens: int) -> None:
        self.tokens = np.zeros(max_tokens, dtype=np.int32)
        self.freq = np.zeros(max_tokens, dtype=np.float32)
        self.count = np.zeros(max_tokens, dtype=np.int32)
        self.match = np.zeros(max_tokens, dtype=np.int32)
        self.conf = np.zeros(max_tokens, dtype=np.float32)
        # addresses once: numpy's .ctypes.data costs microseconds per call, and a round makes 2 walks a request
        self.ptrs = (self.tokens.ctypes.data, self.freq.ctypes.data, self.count.ctypes.data, self.match.ctypes.data)
        self.conf_ptr = self.conf.ctypes.data

    def walk(self, k: int) -> Walk:
        return Walk(self.tokens[:k].tolist(), self.freq[:k].tolist(), self.count[:k].tolist(),
                    self.match[:k].tolist(), self.conf[:k].tolist())


def build_suffix_array(text: np.ndarray, depth: int = DEFAULT_DEPTH) -> np.ndarray:
    """Positions of `text` (separators excluded) sorted by their next `depth` tokens, ties by position."""
    n = len(text)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    rank = text.astype(np.int64) + 1  # separator → 0, below every token
    h = 1
    while True:
        nxt = np.zeros(n, dtype=np.int64)
        nxt[:n - h] = rank[h:] + 1 if h < n else 0  # past the end: 0, below every rank
        key = rank * (int(rank.max()) + 2) + nxt
        order = np.argsort(key, kind="stable")  # ties keep position order
        sorted_key = key[order]
        new_rank = np.empty(n, dtype=np.int64)
        new_rank[order] = np.concatenate([[0], np.cumsum(sorted_key[1:] != sorted_key[:-1])])
        rank = new_rank
        h *= 2
        if h >= depth or int(rank.max()) == n - 1:  # sorted to depth, or every suffix already distinct
            break
    return order[text[order] != SEPARATOR].astype(np.int32)


def concat_documents(docs: Iterable[np.ndarray]) -> np.ndarray:
    """Documents joined by one separator each (int32)."""
    parts: list[np.ndarray] = []
    sep = np.array([SEPARATOR], dtype=np.int32)
    for d in docs:
        if len(d):
            parts += [np.asarray(d, dtype=np.int32), sep]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


class SuffixIndex:
    """A read-only suffix array over documents of token ids; `walk` proposes a continuation."""

    def __init__(self, text: np.ndarray, sa: np.ndarray, depth: int = DEFAULT_DEPTH) -> None:
        self.text = np.ascontiguousarray(text, dtype=np.int32)
        self.sa = np.ascontiguousarray(sa, dtype=np.int32)
        self.depth = depth
        self._lib = suffix_native.required()
        self._text_ptr, self._sa_ptr = self.text.ctypes.data, self.sa.ctypes.data
        # (text, its length, sa, its length) as a native batch call reads them (an empty index: none)
        self.address = (self._text_ptr, len(self.text), self._sa_ptr, len(self.sa)) if len(self.sa) else _NO_INDEX

    @classmethod
    def build(cls, docs: Iterable[np.ndarray], depth: int = DEFAULT_DEPTH) -> SuffixIndex:
        text = concat_documents(docs)
        return cls(text, build_suffix_array(text, depth), depth)

    @classmethod
    def cached(cls, docs: Iterable[np.ndarray], depth: int = DEFAULT_DEPTH, root: Path | None = None) -> SuffixIndex:
        """`build`, or the persisted index of the same text (under `root`, by default the dspark cache)."""
        from dspark.kernels.cache_once import cache_dir

        text = concat_documents(docs)
        digest = hashlib.sha256(text.tobytes() + str(depth).encode()).hexdigest()[:20]
        folder = (root or cache_dir() / "suffix") / digest
        if (folder / "meta.json").exists():
            try:
                return cls(np.load(folder / "text.npy"), np.load(folder / "sa.npy"), depth)
            except (OSError, ValueError) as exc:  # a damaged copy: rebuilt below
                log.warning("suffix index %s unreadable (%r): rebuilding it", folder, exc)
                shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        index = cls(text, build_suffix_array(text, depth), depth)
        log.info("suffix index over %d tokens built in %.1f s", len(text), time.perf_counter() - t0)
        tmp = folder.with_name(f"{digest}.{os.getpid()}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(tmp / "text.npy", index.text)
        np.save(tmp / "sa.npy", index.sa)
        (tmp / "meta.json").write_text(json.dumps({"num_tokens": int(len(text)), "depth": depth}))
        try:
            tmp.rename(folder)
        except OSError:  # another process published the same index first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        return index

    @property
    def num_tokens(self) -> int:
        return int((self.text != SEPARATOR).sum())

    @property
    def nbytes(self) -> int:
        return self.text.nbytes + self.sa.nbytes

    def walk(self, context: np.ndarray, max_tokens: int, params: WalkParams, out: _Out | None = None,
             table: np.ndarray | None = None) -> Walk:
        """The most frequent continuation of the longest matching suffix of `context` (int32, oldest first);
        `table`: the calibration cells its survival is read from (SourceCalibration.cells)."""
        if max_tokens <= 0 or len(self.sa) == 0:
            return Walk.empty()
        out = out or _Out(max_tokens)
        ctx = np.ascontiguousarray(context[-params.max_ctx:], dtype=np.int32)
        k = self._lib.suffix_walk(self._text_ptr, len(self.text), self._sa_ptr, len(self.sa),
                                  ctx.ctypes.data, len(ctx), params.min_ctx, params.max_ctx, self.depth, max_tokens,
                                  params.min_path_prob, params.num_samples, *out.ptrs,
                                  table.ctypes.data if table is not None else None, out.conf_ptr)
        return out.walk(k)


class RequestText:
    """One request's tokens (prompt + output so far) as a growing int32 buffer, walked like the index."""

    def __init__(self) -> None:
        self.buffer = np.zeros(256, dtype=np.int32)
        self.ptr = self.buffer.ctypes.data  # moves only when the buffer grows
        self.length = 0
        self._lib = suffix_native.required()
        self._work = np.zeros(0, dtype=np.int64)

    def sync(self, token_ids: list[int]) -> None:
        """Bring the buffer up to `token_ids` (a request's tokens only grow; a shorter list restarts it)."""
        n = len(token_ids)
        if n < self.length:
            self.length = 0
        if n > len(self.buffer):
            grown = np.zeros(max(2 * len(self.buffer), n), dtype=np.int32)
            grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
            self.ptr = grown.ctypes.data
        if n > self.length:
            self.buffer[self.length:n] = token_ids[self.length:n]
            self.length = n

    def tokens(self) -> np.ndarray:
        return self.buffer[:self.length]

    def walk(self, max_tokens: int, params: WalkParams, out: _Out | None = None,
             table: np.ndarray | None = None) -> Walk:
        if max_tokens <= 0 or self.length < 2:
            return Walk.empty()
        out = out or _Out(max_tokens)
        if len(self._work) < params.max_occurrences:
            self._work = np.zeros(params.max_occurrences, dtype=np.int64)
        k = self._lib.request_walk(self.buffer.ctypes.data, self.length, params.request_min_ctx,
                                   params.request_max_ctx, max_tokens, params.min_path_prob,
                                   params.max_occurrences, self._work.ctypes.data, *out.ptrs,
                                   table.ctypes.data if table is not None else None, out.conf_ptr)
        return out.walk(k)


NUM_SOURCES = 3  # the native batch's sources: 0 request, 1 corpus, 2 served


class BatchWalks:
    """Output buffers of `propose_batch` (every source for every request of a round), grown as needed."""

    def __init__(self, num_requests: int, max_tokens: int) -> None:
        r, k, s = num_requests, max_tokens, NUM_SOURCES
        self.num_requests, self.max_tokens = r, k
        self.tokens = np.zeros((r, s, k), dtype=np.int32)
        self.freq = np.zeros((r, s, k), dtype=np.float32)
        self.count = np.zeros((r, s, k), dtype=np.int32)
        self.match = np.zeros((r, s, k), dtype=np.int32)
        self.conf = np.zeros((r, s, k), dtype=np.float32)
        self.k = np.zeros((r, s), dtype=np.int64)
        self.expected = np.zeros((r, s), dtype=np.float32)
        self.chosen = np.zeros(r, dtype=np.int64)
        self.seq_ptrs = np.zeros(r, dtype=np.int64)
        self.seq_lens = np.zeros(r, dtype=np.int64)
        self.served = np.zeros(4 * r, dtype=np.int64)
        self.tables = np.zeros(s * r, dtype=np.int64)
        self.ptrs = tuple(a.ctypes.data for a in (self.tokens, self.freq, self.count, self.match, self.conf, self.k,
                                                  self.expected, self.chosen))

    def walk(self, r: int, s: int) -> Walk:
        return self.walks([r], [s])[0]

    def walks(self, rows: list[int], sources: list[int]) -> list[Walk]:
        """Request rows[i]'s walk from source sources[i], for every i at once: one gather and one list conversion
        per field for the batch, not five conversions per walk."""
        if not rows:
            return []
        ks = self.k[rows, sources].tolist()
        tok, freq, count, match, conf = (a[rows, sources].tolist()
                                         for a in (self.tokens, self.freq, self.count, self.match, self.conf))
        return [Walk(tok[i][:k], freq[i][:k], count[i][:k], match[i][:k], conf[i][:k]) for i, k in enumerate(ks)]


def propose_batch(texts: list[RequestText], index: SuffixIndex | None, served: list[SuffixIndex | None],
                  params: WalkParams, max_tokens: int, tables: list[tuple[int, int, int]], use: tuple[bool, bool, bool],
                  out: BatchWalks | None, work: np.ndarray) -> BatchWalks:
    """Every source's walk for every request in ONE native call (see `propose_batch` in suffix_kernels.c).
    `served[r]`: request r's tenant's served-text index (None: none); `tables[r]`: the addresses of the
    (request, corpus, served) calibration cells of request r's regime (0: none); `use`: which sources run."""
    n = len(texts)
    if out is None or out.num_requests < n or out.max_tokens != max_tokens:
        out = BatchWalks(_capacity(out, n), max_tokens)
    _point_at(out, texts, served)
    if n and all(t is tables[0] for t in tables):  # one regime's cells for the whole batch (the common case)
        out.tables[:3 * n].reshape(n, 3)[:] = tables[0]
    else:
        out.tables[:3 * n] = [c for cells in tables for c in cells]
    lib = suffix_native.required()
    has_index = index is not None and len(index.sa) > 0
    lib.propose_batch(n, out.seq_ptrs.ctypes.data, out.seq_lens.ctypes.data,
                      index._text_ptr if has_index else None, len(index.text) if has_index else 0,  # type: ignore[union-attr]
                      index._sa_ptr if has_index else None, len(index.sa) if has_index else 0,  # type: ignore[union-attr]
                      out.served.ctypes.data, DEFAULT_DEPTH,
                      params.min_ctx, params.max_ctx, params.request_min_ctx, params.request_max_ctx, max_tokens,
                      params.min_path_prob, params.num_samples, params.max_occurrences, work.ctypes.data,
                      int(use[0]), int(use[1]), int(use[2]), out.tables.ctypes.data, *out.ptrs)
    return out


def _capacity(out: BatchWalks | SampledWalks | None, n: int) -> int:
    """Requests the reallocated buffers hold: doubled only when `n` outgrew them; a new max_tokens (a round drafting
    fewer tokens) keeps the capacity (doubling on every change of it grew the buffers without bound)."""
    if out is None:
        return max(n, 8)
    return out.num_requests if out.num_requests >= n else max(n, 2 * out.num_requests)


def _point_at(out: BatchWalks | SampledWalks, texts: list[RequestText], served: list[SuffixIndex | None]) -> None:
    """Request r's text (address, length) and its served index (text, length, sa, length; a zero length:
    none) into the buffers a native batch call reads."""
    n = len(texts)
    out.seq_ptrs[:n] = [t.ptr for t in texts]  # one conversion a field, not one numpy store a request
    out.seq_lens[:n] = [t.length for t in texts]
    if not any(served):  # no tenant has served text yet (or the source is off): one store
        out.served[:4 * n] = 0
    else:
        out.served[:4 * n] = [x for s in served for x in (s.address if s is not None else _NO_INDEX)]


class SampledWalks:
    """Output buffers of `sample_batch` (one sampled walk per request), grown as needed."""

    def __init__(self, num_requests: int, max_tokens: int, max_q: int) -> None:
        r, k = num_requests, max_tokens
        self.num_requests, self.max_tokens, self.max_q = r, k, max_q
        self.tokens = np.zeros((r, k), dtype=np.int32)
        self.freq = np.zeros((r, k), dtype=np.float32)
        self.count = np.zeros((r, k), dtype=np.int32)
        self.match = np.zeros((r, k), dtype=np.int32)
        self.conf = np.zeros((r, k), dtype=np.float32)
        self.k = np.zeros(r, dtype=np.int64)
        self.q_tokens = np.zeros((r, k, max_q), dtype=np.int32)
        self.q_probs = np.zeros((r, k, max_q), dtype=np.float32)
        self.seq_ptrs = np.zeros(r, dtype=np.int64)
        self.seq_lens = np.zeros(r, dtype=np.int64)
        self.served = np.zeros(4 * r, dtype=np.int64)
        self.sources = np.zeros(r, dtype=np.int64)
        self.tables = np.zeros(r, dtype=np.int64)
        self.uniforms = np.zeros((r, k), dtype=np.float32)
        self.ptrs = tuple(a.ctypes.data for a in (self.tokens, self.freq, self.count, self.match, self.conf, self.k,
                                                  self.q_tokens, self.q_probs))

    def walks(self, n: int) -> list[Walk]:
        """The walks of the first `n` requests (each field converted once for all of them)."""
        q_tokens = self.q_tokens[:n].astype(np.int64)  # copies: the buffers are reused next round
        q_probs = self.q_probs[:n].copy()
        fields = [a[:n].tolist() for a in (self.tokens, self.freq, self.count, self.match, self.conf)]
        return [Walk(*(f[r][:k] for f in fields), q=SparseQ(q_tokens[r, :k], q_probs[r, :k]))
                for r, k in enumerate(self.k[:n].tolist())]


def sample_batch(texts: list[RequestText], index: SuffixIndex | None, served: list[SuffixIndex | None],
                 params: WalkParams, max_tokens: int, sources: list[int], tables: list[int],
                 uniforms: np.ndarray, out: SampledWalks | None, work: np.ndarray) -> SampledWalks:
    """One sampled walk per request, from source `sources[r]` (0 request, 1 corpus, 2 served, -1 none) with
    calibration cells at address `tables[r]` (0: raw), drawing with `uniforms[r]` (max_tokens values in
    [0, 1)), in ONE native call (`sample_batch` in suffix_kernels.c)."""
    n = len(texts)
    max_q = max(1, min(64, params.max_q))
    if out is None or out.num_requests < n or out.max_tokens != max_tokens or out.max_q != max_q:
        out = SampledWalks(_capacity(out, n), max_tokens, max_q)
    _point_at(out, texts, served)
    out.sources[:n] = sources
    out.tables[:n] = tables
    out.uniforms[:n] = uniforms
    has_index = index is not None and len(index.sa) > 0
    suffix_native.required().sample_batch(
        n, out.seq_ptrs.ctypes.data, out.seq_lens.ctypes.data,
        index._text_ptr if has_index else None, len(index.text) if has_index else 0,  # type: ignore[union-attr]
        index._sa_ptr if has_index else None, len(index.sa) if has_index else 0,  # type: ignore[union-attr]
        out.served.ctypes.data, DEFAULT_DEPTH, params.min_ctx, params.max_ctx, params.request_min_ctx,
        params.request_max_ctx, max_tokens, params.min_path_prob, params.num_samples, params.max_occurrences,
        work.ctypes.data, max_q, out.sources.ctypes.data, out.tables.ctypes.data, out.uniforms.ctypes.data, *out.ptrs)
    return out
