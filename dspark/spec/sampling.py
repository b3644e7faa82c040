"""Turning logits into sampling distributions, and sampling from them with explicit noise.

Everything here is vectorised over rows and free of host syncs, so it can run inside the
verify step. Randomness is passed in as tensors (or drawn from a caller's generator) so that
results are reproducible per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Smallest positive normal fp32: keeps Exp(1) noise strictly positive, so probs / noise is
# never 0 / 0 (NaN wins argmax in torch).
_MIN_NOISE = torch.finfo(torch.float32).tiny


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row sampling distribution: temperature, then nucleus (top-p) filtering.

    Args:
        logits: (N, V), any float dtype.
        temperature: (N,). A row with temperature 0 is greedy: its distribution is a
            one-hot at ``argmax(logits)``.
        top_p: (N,) in (0, 1]. Keeps the smallest set of highest-probability tokens whose
            cumulative mass reaches ``top_p`` (the top token is always kept), renormalised.

    Returns:
        (N, V) float32 probabilities; every row sums to 1.
    """
    return filtered_probs(logits, temperature, top_p, is_top_p_needed=True)


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    is_top_p_needed: bool,
) -> torch.Tensor:
    """`logits_to_probs` that can skip the (V log V) sort when the caller knows every
    ``top_p`` is 1 (a host-side fact for the verifier, so no sync is needed to decide it)."""
    logits32 = logits.float()  # (N, V)
    temperature = temperature.to(device=logits.device, dtype=torch.float32)
    top_p = top_p.to(device=logits.device, dtype=torch.float32)
    is_greedy = temperature == 0  # (N,)

    # Greedy rows divide by 1 (their softmax is discarded below) to avoid inf / NaN.
    safe_temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits32 / safe_temperature.unsqueeze(-1), dim=-1)  # (N, V)

    if is_top_p_needed:
        probs = _top_p_filter(probs, top_p)

    greedy_index = logits.argmax(dim=-1, keepdim=True)  # (N, 1)
    one_hot = torch.zeros_like(probs).scatter_(-1, greedy_index, 1.0)  # (N, V)
    return torch.where(is_greedy.unsqueeze(-1), one_hot, probs)


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside each row's nucleus and renormalise. probs (N, V), top_p (N,)."""
    # stable: among tied tokens the lower ids come first (bf16 logits tie often), as in `spec/nucleus.py`
    sorted_probs, sorted_index = probs.sort(dim=-1, descending=True, stable=True)  # (N, V) each
    # A token is kept iff the mass strictly before it is still short of top_p; this keeps
    # the smallest prefix reaching top_p and always keeps the top token (mass before = 0).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (N, V)
    is_kept_sorted = mass_before < top_p.unsqueeze(-1)
    # top_p >= 1 keeps everything, even if fp32 rounding pushes the cumsum past 1.
    is_kept_sorted |= (top_p >= 1).unsqueeze(-1)
    is_kept = torch.zeros_like(is_kept_sorted).scatter_(-1, sorted_index, is_kept_sorted)
    kept = torch.where(is_kept, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Sample one index per row by an exponential race: ``argmax(probs / exp_noise)``.

    Why this samples from ``probs``: with E_i ~ Exp(1) i.i.d., E_i / p_i ~ Exp(rate p_i), and
    the smallest of independent exponentials is the one with index i with probability
    p_i / sum_k p_k. ``argmax(p_i / E_i)`` is exactly ``argmin(E_i / p_i)``. Rows need not be
    normalised (scaling a row does not move its argmax), and zero-probability tokens can
    never win. Unlike ``torch.multinomial`` the noise is an explicit input, so the caller
    controls reproducibility per row.

    Args:
        probs: (N, V) non-negative weights, at least one positive per row.
        exp_noise: (N, V) i.i.d. Exp(1) noise, e.g. from `exponential_noise`.

    Returns:
        (N,) long token ids.
    """
    return (probs / exp_noise.clamp_min(_MIN_NOISE)).argmax(dim=-1)


def exponential_noise(
    shape: Sequence[int] | torch.Size,
    generator: torch.Generator | None,
    device: torch.device | str | None,
) -> torch.Tensor:
    """Exp(1) noise of ``shape`` in float32 as ``-log(U)``, U uniform in (0, 1].

    ``torch.rand`` gives u in [0, 1), so U = 1 - u is never 0 and the log is finite; the
    result is clamped to the smallest positive float so that it can safely divide.
    ``generator=None`` draws from torch's global RNG; a generator must live on ``device``.
    """
    u = torch.rand(tuple(shape), generator=generator, device=device, dtype=torch.float32)
    return u.neg_().log1p_().neg_().clamp_min_(_MIN_NOISE)  # -log(1 - u)
