"""cos / sin of every position a runner can reach, computed once at load.

HF's rotary embeddings compute a position's cos / sin from that position alone (position × inv_freq,
elementwise, then cos / sin and the attention scaling): no reduction over the step's other tokens. So a row
looked up from a table made once is the value the step would compute (to the last bit, but for the vector
or scalar tail of the cos kernel), and the same for a position whatever the step's shape, without the dozen
small ops a step otherwise spends on it. They showed as 6 % of a pool worker's engine-thread samples at 32
requests (py-spy, where the engine thread waits for the GIL that the Ray stream's threads hold); alone, in
process, the table saves 0.5 % of a bf16 step at batch 1 and 32 (2-core Xeon, session 43).

RoPE variants whose frequencies change with the sequence length (dynamic NTK, LongRoPE: transformers'
`dynamic_rope_update`) are computed per step, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tables = dict[str | None, tuple[torch.Tensor, torch.Tensor]]


def is_static(rotary: torch.nn.Module) -> bool:
    """Whether the module's cos / sin depend on the position only (not on how long the sequence has grown)."""
    kinds = getattr(rotary, "rope_type", None)
    if kinds is None:
        return False
    values = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    return all(isinstance(k, str) and "dynamic" not in k and k != "longrope" for k in values)


class RotaryTable:
    """`compute(x, positions)`: the per-step computation (cos, sin (T, rotary_dim) per table key); `probe`: a
    tensor of the runner's dtype and device; positions 0 .. num_positions - 1 are tabled."""

    def __init__(self, compute: Callable[[torch.Tensor, torch.Tensor], Tables], probe: torch.Tensor,
                 num_positions: int) -> None:
        positions = torch.arange(num_positions, device=probe.device)
        computed = compute(probe, positions)
        self.tables = {key: (cos.contiguous(), sin.contiguous()) for key, (cos, sin) in computed.items()}
        self.num_positions = num_positions

    def lookup(self, positions: torch.Tensor) -> Tables:
        return {key: (cos.index_select(0, positions), sin.index_select(0, positions))
                for key, (cos, sin) in self.tables.items()}
