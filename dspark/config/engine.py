"""The engine's configuration (what `EngineConfig` holds, filled from a serve YAML's engine section or the
CLI), and the dtype it resolves to on this machine."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.kernels.cache_once import cache_dir
from dspark.models.target.dtype_choice import chosen_dtype
from dspark.models.target.loader import DEFAULT_TARGET
from dspark.models.target.profiles import recorded_dtype_choice


@dataclass
class EngineConfig:
    target: str = DEFAULT_TARGET
    device: str = "cpu"
    dtype: str | None = None  # None: fp32 on CPU, bf16 on GPU; "auto": the fastest for dtype_role, measured
    dtype_role: str = "verify"  # which operating point "auto" optimises: verify | draft | generate
    drafter: str = "ngram"
    drafter_kwargs: dict = field(default_factory=dict)
    scheduler: str = "fixed"
    scheduler_kwargs: dict = field(default_factory=dict)
    num_draft_tokens: int = 7  # γ: the most a drafter proposes per request and step
    sps_profile: str | None = None  # JSON from `dspark profile`; None: the profile of this machine (profiles.py)
    max_num_seqs: int = 16
    max_model_len: int = 2048
    num_threads: int | None = None
    # skip drafting at batch sizes where it measurably costs more than it returns (load-aware
    # schedulers only: a fixed k always drafts); see spec/draft_gate.py
    draft_gate: bool = True
    # schedule on the measured cost of one more verified token per batch band instead of the profile's slope
    # (load-aware schedulers only); off: it measured slower at batch 8 and 32 (spec/token_cost.py)
    measured_token_cost: bool = False
    # steps kept in `Engine.stats` (None: all, for benchmarks that read and clear them); a long-running
    # server keeps a window, else per-step records would grow without bound
    max_step_stats: int | None = None
    # a streaming caller that fell behind gets the steps it missed as one output (AsyncEngine)
    merge_stream_outputs: bool = False  # measured: no gain over HTTP here (docs/results/engine)
    # a stream sends at most once every this many ms (its first and last output at once), its steps merged:
    # fewer messages downstream (Ray stream items, SSE chunks) for the same tokens (AsyncEngine._due)
    stream_interval_ms: float = 0.0
    # prompt-prefix K/V kept for reuse (prefix_cache.py), MiB; 0 turns automatic prefix caching off
    prefix_cache_mb: int = 256
    # auto: the flattened runner for a family family.py describes, the generic transformers path for any other;
    # transformers: the generic path for every target (what being generic costs, or to rule the native path out)
    model_impl: str = "auto"


def resolve_dtype(config: EngineConfig) -> str | None:
    """The configured dtype, with "auto" replaced by the one measured fastest for the config's role."""
    if config.dtype != "auto":
        return config.dtype
    recorded = recorded_dtype_choice(config.target, config.device)
    return chosen_dtype(config.dtype_role, config.target, config.device, cache_dir(), recorded)
