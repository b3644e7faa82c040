"""The drafter interface: what every draft model (n-gram, oracle, DSpark, baselines) implements."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeGuard

import numpy as np
import torch

if TYPE_CHECKING:
    pass


@dataclass
class DraftRequest:
    """What a drafter sees of one running request at a step."""

    request_id: str
    token_ids: list[int]  # prompt + output so far; the last one is not yet verified-into the cache
    temperature: float
    tenant: str = ""  # who the request is for (see SamplingParams.tenant)


@dataclass
class SparseQ:
    """The q rows of a draft whose distributions have few atoms (a point mass, a source's empirical continuation
    distribution): per position the atoms' token ids and probabilities, -1 / 0 in unused slots. Verification
    writes them into its (T, V) rows for the positions it verifies only; a dense (k, V) row per request would
    cost more than the whole proposal (49,152 floats per position)."""

    tokens: np.ndarray  # (k, m) int64 (numpy: slicing one per request costs a fraction of a torch view)
    probs: np.ndarray  # (k, m) float32

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def point_masses(tokens: list[int]) -> SparseQ:
        return SparseQ(np.asarray(tokens, dtype=np.int64).reshape(-1, 1), np.ones((len(tokens), 1), np.float32))

    def write(self, out: torch.Tensor) -> None:
        """Add the first len(out) positions into `out` (n, V), zero where it is written."""
        n = out.shape[0]
        idx = torch.from_numpy(np.ascontiguousarray(self.tokens[:n], dtype=np.int64)).to(out.device)
        val = torch.from_numpy(np.ascontiguousarray(self.probs[:n])).to(device=out.device, dtype=out.dtype)
        out.scatter_add_(1, idx.clamp_min(0), torch.where(idx >= 0, val, torch.zeros_like(val)))  # unused: + 0


@dataclass
class DraftOutput:
    """One draft round for a batch of requests (index r matches the DraftRequest list)."""

    tokens: list[list[int]]  # k_r ≤ max_num_tokens draft tokens per request
    # per request the distributions sampled from, (k_r, V) or `SparseQ`; None = deterministic drafts
    probs: list[torch.Tensor | SparseQ] | None = None
    confidences: list[list[float]] | None = None  # per request c_{r,1..k_r}: P(accept k | 1..k-1 accepted)
    # drafters with several sources (suffix, hybrid): which one drafted each request ("" = none), and how
    # many proposals each source made this round (chosen or not); for per-source metrics
    sources: list[str] | None = None
    num_proposals: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and len(self.probs) != len(self.tokens):
            raise ValueError("probs must have one entry per request")
        if self.confidences is not None and len(self.confidences) != len(self.tokens):
            raise ValueError("confidences must have one entry per request")
        if self.sources is not None and len(self.sources) != len(self.tokens):
            raise ValueError("sources must have one entry per request")


class Drafter(Protocol):
    name: str

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> DraftOutput:
        """Draft up to max_num_tokens tokens following each request's token_ids."""
        ...

    def release(self, request_id: str) -> None:
        """Forget per-request state once a request leaves the engine."""
        ...


class FeatureDrafter(Drafter, Protocol):
    """A drafter conditioned on target hidden states (DSpark, DFlash, EAGLE-3, MTP).

    The engine runs the target with `hidden_layers` tapped (HF hidden_states indices: 0 = embeddings)
    and, after prefill and after every verification, calls `observe` with the concatenated features
    of exactly the tokens that entered the target's KV cache, in position order.
    """

    hidden_layers: tuple[int, ...]

    def observe(self, request_id: str, features: torch.Tensor) -> None:
        """features: (n, len(hidden_layers) * D_target) for the request's next n cache positions."""
        ...


class FeaturesOptional(Protocol):
    """A feature drafter that can go on without a request's features (the hybrid: from its cheap sources), where
    `features_optional` is true (a remote drafter has the method whatever drafts on the far side). Where
    drafting does not pay at the current load, or where the drafter declines a request's features
    (`wants_features`), the engine stops tapping and feeding the target's hidden states for such a drafter's
    requests (`forgo_features`, once per request, for the rest of its life): they cost every step and there
    bought nothing."""

    features_optional: bool

    def forgo_features(self, request_id: str) -> None:
        """No more features will come for this request: draft it without them; free what was kept for it."""
        ...

    def wants_features(self, request_id: str) -> bool:
        """Whether this request's features are still worth taking (the hybrid: while its feature drafter's
        measured worth pays for them); once False the engine forgoes them."""
        ...


FEATURES_OPTIONAL_DRAFTERS = ("hybrid",)  # drafter kinds whose features may be forgone (remote ones by name)


def features_optional(drafter: object) -> TypeGuard[FeaturesOptional]:
    """Whether `drafter` can go without a request's features (`FeaturesOptional`): the one test the engine and
    the draft service both make."""
    return bool(getattr(drafter, "features_optional", False))


def declines_features(drafter: object, request_id: str) -> bool:
    """Whether a `FeaturesOptional` drafter no longer wants this request's features (`wants_features`)."""
    return features_optional(drafter) and not drafter.wants_features(request_id)


CHECKPOINTS_DIR = Path(__file__).resolve().parents[3] / "checkpoints"
DEFAULT_CHECKPOINTS = {name: CHECKPOINTS_DIR / f"{name}-smollm2" for name in ("dspark", "dflash", "eagle3", "mtp1")}
