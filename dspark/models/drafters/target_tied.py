"""What every feature drafter shares with its target: the draft vocabulary, the frozen embedding and LM head,
and RoPE angles. A mixin for `nn.Module` drafters that registered the buffers `draft_to_target`,
`target_to_draft`, `target_embed`, `draft_lm_head` and `inv_freq`, and name a reference weight whose
device and dtype the attached tensors follow."""

from __future__ import annotations

import torch


class TargetTiedMixin:
    """set_draft_vocab / attach_target / _rope for DSparkModel and ARDraftModel."""

    config: object
    draft_to_target: torch.Tensor
    target_to_draft: torch.Tensor
    target_embed: torch.Tensor | None
    draft_lm_head: torch.Tensor | None
    inv_freq: torch.Tensor
    _target_lm_head: torch.Tensor | None

    def _reference_weight(self) -> torch.Tensor:
        """A trainable weight whose device and dtype the frozen target tensors are moved to."""
        raise NotImplementedError

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Choose the N target tokens the drafter can propose (distinct ids in [0, V_t))."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long).flatten()
        n, vocab = self.config.draft_vocab_size, self.config.target_vocab_size  # type: ignore[attr-defined]
        if ids.numel() != n:
            raise ValueError(f"draft_to_target needs {n} ids, got {ids.numel()}")
        if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != n:
            raise ValueError(f"draft_to_target must hold distinct ids in [0, {vocab})")
        self.draft_to_target.copy_(ids)
        self._rebuild_vocab_maps()

    def _rebuild_vocab_maps(self) -> None:
        n = self.config.draft_vocab_size  # type: ignore[attr-defined]
        self.target_to_draft.fill_(n)
        self.target_to_draft[self.draft_to_target] = torch.arange(n, device=self.draft_to_target.device)
        if self._target_lm_head is not None:
            head = self._target_lm_head[self.draft_to_target.to(self._target_lm_head.device)]
            ref = self._reference_weight()
            self.draft_lm_head = head.to(ref.device, ref.dtype)

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's frozen embedding (V_t, D) and LM head (V_t, D); they are never saved."""
        expected = (self.config.target_vocab_size, self.config.hidden_size)  # type: ignore[attr-defined]
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {expected}")
        ref = self._reference_weight()
        self.target_embed = embed_weight.detach().to(ref.device, ref.dtype)
        self._target_lm_head = lm_head_weight.detach()
        self._rebuild_vocab_maps()

    def _check_attached(self) -> None:
        if self.target_embed is None or self.draft_lm_head is None:
            raise RuntimeError("call attach_target(embed_weight, lm_head_weight) before running the drafter")

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (...,) -> cos, sin (..., hd)."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # (..., hd/2)
        angles = torch.cat([angles, angles], dim=-1)
        dtype = self._reference_weight().dtype
        return angles.cos().to(dtype), angles.sin().to(dtype)
