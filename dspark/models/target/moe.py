"""Sparse top-k mixture of experts over a step's flattened tokens (Qwen3-MoE).

Routing is one GEMM and one top-k for all T tokens of the step; the (token, expert) pairs are then sorted by
expert, so each expert runs ONE gate|up and one down GEMM on exactly the rows routed to it, and its weighted
output is added back into those rows. The Python loop is over experts that received tokens, never over
tokens; the per-expert row counts are read to the host once per MoE layer (free on CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class SparseMoE:
    """Router (E, D), experts' fused gate|up (E, 2I, D) and down (E, D, I)."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                 normalize_top_k: bool, activation: str) -> None:
        self.router = router.detach().contiguous()
        self.gate_up = gate_up.detach().contiguous()
        self.down = down.detach().contiguous()
        self.num_experts = router.shape[0]
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.activation = activation

    @classmethod
    def from_hf(cls, block: torch.nn.Module, cfg: Any, activation: str) -> SparseMoE:
        """From a HF sparse MoE block: transformers 5 keeps the experts as 3D tensors; earlier versions as a
        list of MLP modules (stacked here)."""
        experts = block.experts
        router = block.gate.weight
        if isinstance(experts, torch.nn.ModuleList):
            gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
            down = torch.stack([e.down_proj.weight for e in experts])
        else:
            gate_up, down = experts.gate_up_proj, experts.down_proj
        return cls(router, gate_up, down, int(cfg.num_experts_per_tok), bool(getattr(cfg, "norm_topk_prob", False)),
                   activation)

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, D) -> (T, D): Σ over each token's top-k experts of weight · expert(x)."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)  # (T, E)
        top_w, top_e = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.normalize_top_k:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        flat_e = top_e.flatten()  # (T * k,) pair p = token p // k
        order = torch.argsort(flat_e, stable=True)  # pairs grouped by expert, tokens ascending within one
        token = order // self.top_k
        weight = top_w.flatten()[order]
        rows = x[token]  # (T * k, D)
        counts = torch.bincount(flat_e, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            lo, hi = start, start + n
            gate, up = F.linear(rows[lo:hi], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self._act(gate) * up, self.down[e]) * weight[lo:hi, None]
            out.index_add_(0, token[lo:hi], y)
            start = hi
        return out
