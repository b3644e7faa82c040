"""Target cache: tapped hidden states (bf16), final hidden state and full-vocab logsumexp per token.

The drafter's training needs, per token, the target features it is conditioned on and the target's
distribution p_t. Storing the final (pre-norm) hidden state and the full-vocab logsumexp lets the
trainer rebuild p_t over the draft vocabulary with one (D × N) matmul instead of the 49k-row LM head.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dspark.models.target.layer import SeqChunk
from dspark.models.target.loader import TargetModel
from dspark.models.target.runner import TargetRunner


@dataclass
class CachedShard:
    token_ids: torch.Tensor  # (T,) long, sequences concatenated
    offsets: torch.Tensor  # (S + 1,) long
    prompt_lens: torch.Tensor  # (S,) long
    features: torch.Tensor  # (T, taps * D) bf16
    final_hidden: torch.Tensor  # (T, D) fp32 (bf16 from a bf16 target), before the final norm
    lse: torch.Tensor  # (T,) fp32, logsumexp of the full-vocab target logits

    @classmethod
    def load(cls, path: Path) -> CachedShard:
        t = load_file(str(path))
        return cls(t["token_ids"], t["offsets"], t["prompt_lens"], t["features"], t["final_hidden"], t["lse"])

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Sequence i: (token_ids, features, final_hidden, lse, prompt_len)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return (self.token_ids[a:b], self.features[a:b], self.final_hidden[a:b], self.lse[a:b],
                int(self.prompt_lens[i]))


@torch.inference_mode()
def cache_sequences(target: TargetModel, seqs: list[tuple[list[int], int]], layers: list[int],
                    batch_tokens: int = 2048, max_seqs: int = 16) -> dict[str, torch.Tensor]:
    """Run the target over (token_ids, prompt_len) sequences; return the shard's tensors.

    The final hidden state is kept in the target's dtype (bf16 when the target runs in bf16: no loss);
    any GEMM kernel may be used (a cache needs no row invariance)."""
    final_layer = target.model.config.num_hidden_layers
    max_len = max(len(s) for s, _ in seqs)
    runner = TargetRunner(target.model, max_num_seqs=max_seqs, max_model_len=max_len + 1, row_invariant=False)
    final_dtype = torch.bfloat16 if target.dtype == torch.bfloat16 else torch.float32
    feats, finals, lses = [], [], []
    i = 0
    while i < len(seqs):
        group, n_tok = [], 0
        while i < len(seqs) and len(group) < max_seqs and (not group or n_tok + len(seqs[i][0]) <= batch_tokens):
            group.append(seqs[i][0])
            n_tok += len(seqs[i][0])
            i += 1
        runner.cache.num_active = 0
        slots = [runner.cache.allocate() for _ in group]
        out = runner.forward([SeqChunk(s, 0, ids, len(ids)) for s, ids in zip(slots, group)],
                             hidden_layers=tuple(layers) + (final_layer,))
        feats.append(torch.cat([out.hidden_states[j] for j in layers], dim=-1).to(torch.bfloat16))
        finals.append(out.hidden_states[final_layer].to(final_dtype).clone())
        lses.append(torch.logsumexp(out.logits.float(), dim=-1))
    lengths = torch.tensor([len(s) for s, _ in seqs])
    return {"token_ids": torch.tensor([t for s, _ in seqs for t in s]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "prompt_lens": torch.tensor([p for _, p in seqs]),
            "features": torch.cat(feats), "final_hidden": torch.cat(finals), "lse": torch.cat(lses)}


def build_cache(target: TargetModel, records: list[dict], layers: list[int], out_dir: Path,
                shard_size: int = 32, max_len: int = 768) -> dict:
    """Cache shards cache-XXXX.safetensors (resumable: existing shards are kept)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    num_tokens = 0
    for k in tqdm(range(0, len(records), shard_size), desc="target cache", unit="shard"):
        path = out_dir / f"cache-{k // shard_size:04d}.safetensors"
        chunk = records[k:k + shard_size]
        seqs = [((r["prompt_ids"] + r["response_ids"])[:max_len], len(r["prompt_ids"])) for r in chunk]
        num_tokens += sum(len(s) for s, _ in seqs)
        if path.exists():
            continue
        tensors = cache_sequences(target, seqs, layers)
        tmp = path.with_suffix(".tmp")
        save_file({k2: v.contiguous() for k2, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
    meta = {"layers": layers, "num_records": len(records), "num_tokens": num_tokens, "max_len": max_len}
    (out_dir / "meta.json").write_text(json.dumps(meta))
    return meta
