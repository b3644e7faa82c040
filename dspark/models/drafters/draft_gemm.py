"""The drafter's GEMMs at inference, on the kernel measured fastest on this machine (as the target's are).

A DSpark draft round at batch 1 multiplies a handful of rows by every weight of the drafter: the draft
LM head (N × D), the transition matrix W2 once per block position, each draft layer's projections, and
`fc` over newly observed context rows. PyTorch's GEMMs are slow at few rows on a CPU (2-AVX-512 EPYC,
fp32, 7 rows: the 8,192 × 576 head 1.7 ms as W @ xᵀ, 0.26 ms in the native kernel), so the kernel is
chosen per row bucket by `gemm_plan` on the drafter's own weights, measured once per machine and cached
like the target's plan. Drafts are verified, so no row invariance is needed here.

Each weight is planned from the parameter it belongs to; a parameter changed in place since (training
after serving) is re-read on its next use, so a stale copy never drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels.gemm_plan import GemmPlan, PlannedLinear, plan_for, wx_linear

HEAD = "head"
Sources = dict[str, tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]


class _Source:
    """Where a planned weight comes from: the tensor `get()` returns now (a parameter, or a buffer that may be
    replaced, like the draft LM head when the draft vocabulary changes) and how the (out, in) weight is
    derived from it."""

    def __init__(self, get: Callable[[], torch.Tensor], derive: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.get, self.derive = get, derive
        self.tensor: torch.Tensor | None = None
        self.version = -1

    def is_stale(self) -> bool:
        tensor = self.get()
        return tensor is not self.tensor or tensor._version != self.version

    def weight(self) -> torch.Tensor:
        self.tensor = self.get()
        self.version = self.tensor._version
        return self.derive(self.tensor.detach()).contiguous()


class DraftGemm:
    """Planned linears by name; `__call__(name, x)` is x @ weightᵀ for x of any leading shape."""

    def __init__(self, sources: Sources, cache_root: Path | None) -> None:
        if HEAD not in sources:
            raise ValueError(f"a draft GEMM plan needs a {HEAD!r} weight")
        self.sources = {name: _Source(get, derive) for name, (get, derive) in sources.items()}
        self.linears = {name: PlannedLinear(src.weight(), name=f"draft_{name}") for name, src in self.sources.items()}
        layers = [lin for name, lin in self.linears.items() if name != HEAD]
        self.plan: GemmPlan = plan_for(layers, self.linears[HEAD], cache_root, row_invariant=False)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        src, lin = self.sources[name], self.linears[name]
        if src.is_stale():  # replaced or changed in place since it was planned: take the new values
            fresh = PlannedLinear(src.weight(), name=lin.name)
            if lin.packed is not None:
                fresh.pack()
            self.linears[name] = lin = fresh
        flat = x.reshape(-1, x.shape[-1])
        out = lin(flat, self.plan.kernel(flat.shape[0], is_head=name == HEAD))
        return out.reshape(*x.shape[:-1], out.shape[-1])


class GemmPlanned:
    """Mixin for a draft model and its layers: `_linear(key, x, weight)` runs on the model's `DraftGemm` at
    inference (key: the module's name in the model, a dot, then `key`), on F.linear while autograd is on."""

    gemm: DraftGemm | None = None
    gemm_prefix = ""

    def _linear(self, key: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.gemm is None or torch.is_grad_enabled():
            return F.linear(x, weight)
        return self.gemm(self.gemm_prefix + key, x)

    def _head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ the draft LM headᵀ: the planned kernel, or W @ xᵀ (faster than F.linear for few rows)."""
        if self.gemm is None or torch.is_grad_enabled():
            return wx_linear(x, weight)
        return self.gemm(HEAD, x)


def same(t: torch.Tensor) -> torch.Tensor:
    return t


def layer_sources(name: str, layer: nn.Module) -> Sources:
    """The projections of a draft decoder layer (fused qkv_proj, o_proj, gate_up_proj, down_proj)."""
    return {f"{name}.qkv": (lambda: layer.qkv_proj.weight, same), f"{name}.o": (lambda: layer.o_proj.weight, same),
            f"{name}.gate_up": (lambda: layer.gate_up_proj.weight, same),
            f"{name}.down": (lambda: layer.down_proj.weight, same)}


def attach_gemm(model: nn.Module, sources: Sources, cache_root: Path | None) -> DraftGemm:
    """Plan `sources` on this machine and hand the plan to every GemmPlanned module of `model`."""
    gemm = DraftGemm(sources, cache_root)
    for name, module in model.named_modules():
        if isinstance(module, GemmPlanned):
            module.gemm, module.gemm_prefix = gemm, f"{name}." if name else ""
    return gemm
