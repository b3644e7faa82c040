"""Pure speculative-decoding algorithms (no Ray, no models): sampling, lossless verification,
prefix survival, SPS profiles and verification-length schedulers."""

from dspark.spec.sampling import exponential_noise, logits_to_probs, sample_from_probs
from dspark.spec.schedulers import (
    SCHEDULER_NAMES,
    AsyncCapacity,
    FixedK,
    GlobalSearch,
    GreedyEarlyStop,
    Scheduler,
    Threshold,
    make_scheduler,
)
from dspark.spec.sps import SPSTable
from dspark.spec.survival import AcceptanceTracker, prefix_survival
from dspark.spec.verification import VerifyInput, VerifyOutput, verify

__all__ = [
    "SCHEDULER_NAMES",
    "AcceptanceTracker",
    "AsyncCapacity",
    "FixedK",
    "GlobalSearch",
    "GreedyEarlyStop",
    "SPSTable",
    "Scheduler",
    "Threshold",
    "VerifyInput",
    "VerifyOutput",
    "exponential_noise",
    "logits_to_probs",
    "make_scheduler",
    "prefix_survival",
    "sample_from_probs",
    "verify",
]
