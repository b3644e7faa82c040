"""Sampling one token per row at temperature / top-p without materialising or sorting (N, V) rows.

A plain target step (no drafts to verify) only needs one sample per request from its filtered
distribution. The general verifier builds full (N, V) probabilities, sorts every row for top-p and
draws V exponentials per request: at 256 requests and V = 49,152 that is ~0.9 s on a 2-core CPU,
several times the forward pass. Here the work on whole rows is a max, an exp and a sum; everything
else runs on a few hundred candidates per row:

- Candidates: tokens with p > (1 − top_p) / (2V). What lies below that bound has mass at most
  (1 − top_p) / 2 < 1 − top_p, so the candidates always reach top_p and contain the whole nucleus
  (the smallest highest-probability set reaching top_p, the top token always kept). This is exact,
  not an approximation: no fallback is needed.
- The candidates of every row are sorted together by (row, −p), the nucleus is cut with a segmented
  cumulative sum, and the token is drawn by the same exponential race as `sample_from_probs`
  (argmax p / E, E ~ Exp(1) from the request's own generator), over the nucleus only.
- top_p = 1 rows race over the whole row (their nucleus is the whole vocabulary); greedy rows take
  the argmax.
- With the native kernels (`kernels/native.py`), the passes over whole rows (max, exp, sum, candidates)
  are one native call for all rows, fp32 or bf16 logits read in place; a row with more than
  NATIVE_CANDIDATE_CAP candidates, and the top_p = 1 rows, take the PyTorch passes.
"""

from __future__ import annotations

import torch

from dspark.kernels import native
from dspark.spec.sampling import exponential_noise

_ROWS_PER_CHUNK = 16  # (16, V) fp32 working rows stay in cache: each pass over them is cheap
NATIVE_CANDIDATE_CAP = 2048  # candidates a row may have in the native pass (SmolLM2 at T 0.7, top-p 0.9: ~10-300)


def sample_nucleus(logits: torch.Tensor, temperature: list[float], top_p: list[float],
                   generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits (N, V), distributed as softmax(logits / T) restricted to top-p."""
    if (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous()
            and native.is_available()):
        return _sample_native(logits, temperature, top_p, generators)
    return _sample_torch(logits, temperature, top_p, generators)


def _sample_native(logits: torch.Tensor, temperature: list[float], top_p: list[float],
                   generators: list[torch.Generator | None]) -> list[int]:
    num_rows, vocab = logits.shape
    tokens = [0] * num_rows
    taken = [r for r in range(num_rows) if temperature[r] == 0 or top_p[r] < 1.0]
    rest = [r for r in range(num_rows) if not (temperature[r] == 0 or top_p[r] < 1.0)]
    if taken:
        sub = logits if len(taken) == num_rows else logits[taken]
        cand = native.nucleus_candidates(sub, [temperature[r] for r in taken],
                                         [(1.0 - top_p[r]) / (2 * vocab) for r in taken], NATIVE_CANDIDATE_CAP)
        nucleus: list[tuple[int, int]] = []  # (row of sub, row of logits)
        for j, r in enumerate(taken):
            if temperature[r] == 0:
                tokens[r] = cand.argmax[j]
            elif cand.count[j] > NATIVE_CANDIDATE_CAP:
                rest.append(r)
            else:
                nucleus.append((j, r))
        if nucleus:
            sel = torch.tensor([j for j, _ in nucleus])
            counts = torch.tensor([cand.count[j] for j, _ in nucleus])
            rows = torch.repeat_interleave(torch.arange(len(nucleus)), counts)  # ascending, as nonzero's
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.arange(len(rows)) - starts[rows]
            cols = cand.idx[sel][rows, pos].long()
            probs = cand.weight[sel][rows, pos].double() / cand.total[sel][rows]
            picked = _race_in_nucleus(rows, cols, probs, [top_p[r] for _, r in nucleus],
                                      [generators[r] for _, r in nucleus])
            for (_, r), tok in zip(nucleus, picked):
                tokens[r] = tok
    if rest:
        rest.sort()
        picked = _sample_torch(logits[rest], [temperature[r] for r in rest], [top_p[r] for r in rest],
                               [generators[r] for r in rest])
        for r, tok in zip(rest, picked):
            tokens[r] = tok
    return tokens


def _sample_torch(logits: torch.Tensor, temperature: list[float], top_p: list[float],
                  generators: list[torch.Generator | None]) -> list[int]:
    num_rows, vocab = logits.shape
    device = logits.device
    tokens = [0] * num_rows
    cand_rows: list[torch.Tensor] = []
    cand_cols: list[torch.Tensor] = []
    cand_probs: list[torch.Tensor] = []
    nucleus_rows: list[int] = []
    for lo in range(0, num_rows, _ROWS_PER_CHUNK):
        hi = min(num_rows, lo + _ROWS_PER_CHUNK)
        x = logits[lo:hi].to(torch.float32, copy=True)  # (n, V) ours to overwrite
        peak, argmax = x.max(dim=-1)
        argmax_host = argmax.tolist()
        temp = torch.tensor([t if t > 0 else 1.0 for t in temperature[lo:hi]], device=device)
        weights = x.sub_(peak[:, None]).div_(temp[:, None]).exp_()  # (n, V) unnormalised p, max 1
        totals = weights.sum(dim=-1, dtype=torch.float64)  # (n,)
        for j, r in enumerate(range(lo, hi)):
            if temperature[r] == 0:
                tokens[r] = argmax_host[j]
            elif top_p[r] >= 1.0:  # the nucleus is the whole row: race over it (as sample_from_probs)
                noise = exponential_noise((vocab,), generators[r], device)
                tokens[r] = int((weights[j] / noise).argmax())
            else:
                nucleus_rows.append(r)
        chunk_nucleus = [j for j, r in enumerate(range(lo, hi)) if temperature[r] > 0 and top_p[r] < 1.0]
        if chunk_nucleus:
            sub = torch.tensor(chunk_nucleus, device=device)
            bound = torch.tensor([(1.0 - top_p[lo + j]) / (2 * vocab) for j in chunk_nucleus],
                                 device=device, dtype=torch.float64) * totals[sub]
            w = weights[sub]
            rows, cols = (w > bound.float()[:, None]).nonzero(as_tuple=True)  # row-major: rows ascending
            cand_rows.append(rows + (len(nucleus_rows) - len(chunk_nucleus)))
            cand_cols.append(cols)
            cand_probs.append(w[rows, cols].double() / totals[sub][rows])
    if nucleus_rows:
        picked = _race_in_nucleus(torch.cat(cand_rows), torch.cat(cand_cols), torch.cat(cand_probs),
                                  [top_p[r] for r in nucleus_rows], [generators[r] for r in nucleus_rows])
        for r, tok in zip(nucleus_rows, picked):
            tokens[r] = tok
    return tokens


def _race_in_nucleus(rows: torch.Tensor, cols: torch.Tensor, probs: torch.Tensor, top_p: list[float],
                     generators: list[torch.Generator | None]) -> list[int]:
    """Candidates (C,) as (row, token, p) with rows ascending; returns one sampled token per row."""
    num_rows = len(top_p)
    device = probs.device
    top_p_t = torch.tensor(top_p, device=device, dtype=torch.float64)
    counts = torch.bincount(rows, minlength=num_rows)  # (S,)
    # by row, then p descending; stable, so tied tokens keep ascending ids whatever else the batch holds
    order = torch.argsort(rows.double() * 2.0 + (1.0 - probs), stable=True)
    rows, cols, probs = rows[order], cols[order], probs[order]
    starts = torch.cumsum(counts, 0) - counts  # (S,) first candidate of each row
    exclusive = torch.cumsum(probs, 0) - probs  # (C,) mass before each candidate, over all rows
    mass_before = exclusive - exclusive[starts][rows]  # (C,) ... within its own row
    is_kept = mass_before < top_p_t[rows]  # the top candidate (mass before 0) is always kept
    noise = torch.cat([exponential_noise((n,), g, device) for n, g in zip(counts.tolist(), generators)])
    score = torch.where(is_kept, probs / noise.double(), torch.zeros_like(probs))  # (C,)
    best = torch.zeros(num_rows, dtype=score.dtype, device=device).scatter_reduce(
        0, rows, score, reduce="amax")
    position = torch.arange(len(score), device=device)
    is_winner = is_kept & (score == best[rows])
    first = torch.full((num_rows,), len(score), device=device).scatter_reduce(
        0, rows, torch.where(is_winner, position, len(score)), reduce="amin")
    return cols[first].tolist()
