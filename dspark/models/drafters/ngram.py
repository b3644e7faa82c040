"""Prompt-lookup n-gram drafter (training-free): copy what followed the latest earlier match."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.models.drafters.base import DraftOutput, DraftRequest


@dataclass
class NgramDrafter:
    """Find the longest suffix n-gram (max_ngram down to min_ngram) earlier in the sequence and
    propose the tokens that followed its most recent occurrence. Drafts are deterministic."""

    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "ngram"

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        return DraftOutput(tokens=[self._lookup(r.token_ids, max_num_tokens) for r in requests])

    def _lookup(self, seq: list[int], k: int) -> list[int]:
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            suffix = seq[n_seq - n:]
            # most recent earlier occurrence whose continuation is non-empty
            for start in range(n_seq - n - 1, -1, -1):
                if seq[start:start + n] == suffix:
                    return seq[start + n:start + n + k]
        return []

    def release(self, request_id: str) -> None:
        pass
