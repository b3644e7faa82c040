"""Does this CPU's low-precision runner give a token the same logits however many tokens its step carries?

Lossless speculation in bf16 needs it: the verify step scores 1 + ℓ tokens of a request at once, target-only
decoding scores them one by one, and bf16 rounds every GEMM output and every attention sum to 8 bits of
mantissa, so a kernel whose reduction order changes with the row count changes greedy choices. The GEMM
plan keeps only row-invariant GEMM kernels (gemm_plan._is_row_invariant); this probe checks the whole
forward on the model itself, because the rest of it (attention over 1 vs 8 queries, norms, rotary) can vary
too: on a 2-core AMD EPYC with avx512_bf16 and no AMX it did while oneDNN ran its bf16 GEMMs (the native
AVX512-BF16 kernel since session 47 made it invariant there); on the AMX Xeon it does not.
"""

from __future__ import annotations

import weakref

import torch

from dspark.models.target.layer import SeqChunk
from dspark.models.target.runner import TargetRunner

# by model object, forgotten with it (an id could be reused by the next model loaded)
_SEEN: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def is_row_invariant(model: torch.nn.Module, context_len: int = 40, num_tokens: int = 8) -> bool:
    """True when `num_tokens` tokens verified in one step get bit for bit the logits of as many one-token
    steps over the same cached context (measured once per model object)."""
    if model not in _SEEN:
        runner = TargetRunner(model, 2, context_len + num_tokens + 1)
        block_slot, single_slot = runner.cache.allocate(), runner.cache.allocate()
        gen = torch.Generator().manual_seed(0)
        ctx = torch.randint(0, runner.vocab_size, (context_len,), generator=gen).tolist()
        nxt = torch.randint(0, runner.vocab_size, (num_tokens,), generator=gen).tolist()
        with torch.inference_mode():
            for slot in (block_slot, single_slot):
                runner.forward([SeqChunk(slot, 0, ctx, 1)])
            block = runner.forward([SeqChunk(block_slot, context_len, nxt, num_tokens)]).logits
            rows = [runner.forward([SeqChunk(single_slot, context_len + i, nxt[i:i + 1], 1)]).logits[-1]
                    for i in range(num_tokens)]
        _SEEN[model] = all(torch.equal(block[i], row) for i, row in enumerate(rows))
    return _SEEN[model]
