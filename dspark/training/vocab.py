"""Reduced draft vocabulary: the N most frequent target tokens of the training data."""

from __future__ import annotations

from collections import Counter

COVERAGE_GRID = (1024, 2048, 4096, 8192, 16384, 32768)


def token_counts(records: list[dict]) -> Counter:
    counts: Counter = Counter()
    for r in records:
        counts.update(r["response_ids"])
    return counts


def coverage_table(counts: Counter, grid: tuple[int, ...] = COVERAGE_GRID) -> dict[int, float]:
    """Share of response tokens inside the top-N set, for each N."""
    total = sum(counts.values())
    freqs = sorted(counts.values(), reverse=True)
    out, acc, j = {}, 0, 0
    for n in sorted(grid):
        while j < min(n, len(freqs)):
            acc += freqs[j]
            j += 1
        out[n] = acc / total if total else 0.0
    return out


def build_draft_vocab(counts: Counter, size: int, always: list[int]) -> list[int]:
    """Top-`size` ids by frequency (ties by id), `always` (e.g. EOS) forced in; sorted by target id."""
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    chosen = list(dict.fromkeys(always + ranked))[:size]
    return sorted(chosen)
