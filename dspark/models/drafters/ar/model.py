"""The autoregressive feature drafter shared by the EAGLE-3 and MTP-1 baselines.

Drafter position j reads the target feature of position j (encoded by the subclass: EAGLE-3 fuses the
low/mid/high taps with a linear layer, MTP-1 takes the final hidden state as is) and the embedding of the
token x_{j+1}: input_j = W_in [RMSNorm(emb(x_{j+1})) ; RMSNorm(feature_j)] (2D -> D). One causal decoder
layer over the positions gives a_j, whose logits (frozen target LM head over the draft vocabulary) predict
x_{j+2}. Drafting from an anchor x_n: step 1 is the real position n-1 (feature and token both known);
step s ≥ 2 sits at position n+s-2 and feeds back the layer's own output a of the previous step as its
feature, with the previous draft token (EAGLE-3's training-time test trains exactly this). The frozen
target embedding and LM head are attached, never saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.models.drafters.ar.config import ARDraftConfig
from dspark.models.drafters.draft_gemm import DraftGemm, GemmPlanned, Sources, attach_gemm, layer_sources, same
from dspark.models.drafters.draft_sampling import sample_draft_token
from dspark.models.drafters.dspark.model import DSparkTrainOutput
from dspark.models.drafters.target_tied import TargetTiedMixin
from dspark.models.target.family import decoder_layer_weights, final_norm_weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF Llama convention (rotate_half); cos/sin broadcast against x (..., hd)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass
class ARDraftBlock:
    """One inference round for R requests: k draft tokens each, plus the K/V of the real positions run."""

    draft_ids: torch.Tensor  # (R, k) long, draft-vocab ids
    logits: torch.Tensor  # (R, k, N) before temperature
    probs: torch.Tensor | None  # (R, k, N) the distribution each token was drawn from; None if all greedy
    new_kv: torch.Tensor  # (2, R, Hkv, P, hd) K (RoPE'd) and V of the pending real positions (padded to P)


class _CausalLayer(GemmPlanned, nn.Module):
    """Pre-norm attention + SwiGLU MLP over [past K/V ; own K/V]; returns its own K/V for caching."""

    def __init__(self, cfg: ARDraftConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.input_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=False)  # fused q|k|v
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.post_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)  # fused gate|up
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor | None,
                past_v: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, Q, D); cos/sin (B, 1, Q, hd) or (Q, hd); past_k/v (B, Hkv, P, hd); mask (B, 1, Q, P+Q) bool.

        Returns the output (B, Q, D) and this call's K (RoPE'd), V, each (B, Hkv, Q, hd).
        """
        h = self.input_norm(x)
        qkv = self._linear("qkv", h, self.qkv_proj.weight).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = (k, v) if past_k is None else (torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2))
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # (B, H, Q, hd)
        x = x + self._linear("o", attn.transpose(1, 2).flatten(2), self.o_proj.weight)
        gate, up = self._linear("gate_up", self.post_norm(x), self.gate_up_proj.weight).chunk(2, dim=-1)
        return x + self._linear("down", F.silu(gate) * up, self.down_proj.weight), k, v


class ARDraftModel(GemmPlanned, TargetTiedMixin, nn.Module):
    """Trainable part of a one-layer autoregressive drafter; subclasses define `encode_features`."""

    config_class: ClassVar[type[ARDraftConfig]] = ARDraftConfig

    def __init__(self, config: ARDraftConfig, draft_to_target: torch.Tensor | None = None) -> None:
        super().__init__()
        cfg = self.config = config
        d, n = cfg.hidden_size, cfg.draft_vocab_size
        self.embed_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.feature_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.in_proj = nn.Linear(2 * d, d, bias=False)  # [emb ; feature] -> D
        self.layer = _CausalLayer(cfg)
        self.norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self._build_feature_encoder()
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("draft_to_target", torch.arange(n), persistent=True)  # (N,) saved with the weights
        self.register_buffer("target_to_draft", torch.zeros(cfg.target_vocab_size, dtype=torch.long),
                             persistent=False)  # (V_t,) N for tokens outside the draft vocab
        self.register_buffer("target_embed", None, persistent=False)  # (V_t, D) frozen, attached
        self.register_buffer("draft_lm_head", None, persistent=False)  # (N, D) target_lm_head[draft_to_target]
        self._target_lm_head: torch.Tensor | None = None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        self.set_draft_vocab(draft_to_target if draft_to_target is not None else torch.arange(n))
        self.register_load_state_dict_post_hook(lambda module, _keys: module._rebuild_vocab_maps())

    # ---- subclass hooks ------------------------------------------------------------------------------
    def _build_feature_encoder(self) -> None:
        """Create the modules `encode_features` uses (none by default)."""

    def encode_features(self, features: torch.Tensor) -> torch.Tensor:
        """Observed target features (..., taps*D_t) -> drafter feature (..., D)."""
        raise NotImplementedError

    def _feature_encoder_sources(self) -> Sources:
        """The feature encoder's weights for the inference GEMM plan (none by default)."""
        return {}

    @torch.no_grad()
    def _init_feature_encoder_from_target(self) -> None:
        """Start the feature encoder as a pass-through of the highest tapped layer (none by default)."""

    # ---- initialisation from the target --------------------------------------------------------------
    @torch.no_grad()
    def init_from_target(self, target_model: nn.Module) -> list[int]:
        """Start from the target's top decoder layer (HF Llama layout) instead of random weights.

        The decoder layer copies target layer L-1 (norms, attention, MLP), `norm` the target's final norm;
        `in_proj` starts as the identity on the feature half (small on the embedding half) so the layer
        first sees the target's own hidden state. Returns the target layer indices copied.
        """
        layers = target_model.model.layers
        theirs, mine = decoder_layer_weights(target_model, len(layers) - 1), self.layer  # any family (family.py)
        pairs = [(mine.qkv_proj.weight, theirs.qkv.weight), (mine.o_proj.weight, theirs.o.weight),
                 (mine.input_norm.weight, theirs.in_norm), (mine.post_norm.weight, theirs.post_norm),
                 (self.norm.weight, final_norm_weight(target_model))]
        if theirs.gate_up is not None:  # a sparse-expert layer keeps the draft MLP's random init
            pairs += [(mine.gate_up_proj.weight, theirs.gate_up.weight), (mine.down_proj.weight, theirs.down.weight)]
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise ValueError(f"target layer shape {tuple(src.shape)} != draft {tuple(dst.shape)}")
            dst.copy_(src)
        d = self.config.hidden_size
        self.in_proj.weight.mul_(0.1)
        self.in_proj.weight[:, d:] += torch.eye(d, dtype=self.in_proj.weight.dtype)
        self._init_feature_encoder_from_target()
        return [len(layers) - 1]

    # ---- vocabulary and frozen target weights ------------------------------------------------------
    def _reference_weight(self) -> torch.Tensor:
        return self.in_proj.weight

    # ---- one layer step ------------------------------------------------------------------------------
    def _input(self, feature: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """feature (..., D) drafter feature, token_ids (...,) target ids -> layer input (..., D)."""
        emb = self.embed_norm(self.target_embed[token_ids])
        return self._linear("in_proj", torch.cat([emb, self.feature_norm(feature)], dim=-1), self.in_proj.weight)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Layer output (..., D) -> draft-vocab logits (..., N)."""
        return F.linear(self.norm(hidden), self.draft_lm_head)

    # ---- training ------------------------------------------------------------------------------------
    def forward_train(self, features: torch.Tensor, token_ids: torch.Tensor, anchor_positions: torch.Tensor,
                      seq_lens: torch.Tensor | None = None,
                      is_anchor_valid: torch.Tensor | None = None) -> DSparkTrainOutput:
        """Training-time test over M blocks per sequence: the same outputs as `DSparkModel.forward_train`.

        features (B, L, taps*D_t); token_ids (B, L); anchor_positions (B, M) long (≥ 1: step 1 reads the
        feature of position anchor-1; anchor 0 blocks are marked invalid); seq_lens (B,); is_anchor_valid
        (B, M). One causal pass over every real position gives step 1 (and the K/V every step attends to);
        step k ≥ 2 feeds back step k-1's output as its feature, with the ground-truth previous token, and
        sees real positions < anchor and its own block's earlier steps only.
        """
        self._check_attached()
        gamma = self.config.block_size
        (b, seq_len, _), m = features.shape, anchor_positions.shape[1]
        dev = features.device
        next_ids = torch.cat([token_ids[:, 1:], token_ids[:, -1:]], dim=1)  # x_{j+1}; the last is never read
        x = self._input(self.encode_features(features), next_ids)  # (B, L, D)
        cos, sin = self._rope(torch.arange(seq_len, device=dev))  # (L, hd)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=dev).tril()
        real, real_k, real_v = self.layer(x, cos, sin, None, None, causal)  # (B, L, D), (B, Hkv, L, hd)
        # step 1 of the block at anchor a is the real position a-1
        first = (anchor_positions - 1).clamp_min(0)
        hidden = real.gather(1, first[..., None].expand(b, m, real.shape[-1]))  # (B, M, D)
        steps = [hidden]
        sees_real = torch.arange(seq_len, device=dev) < anchor_positions[:, :, None]  # (B, M, L)
        own = torch.eye(m, dtype=torch.bool, device=dev).expand(b, m, m)
        past_k, past_v, mask = real_k, real_v, sees_real
        for k in range(2, gamma + 1):
            prev_ids = token_ids.gather(1, (anchor_positions + k - 1).clamp(max=seq_len - 1))  # x_{a+k-1}
            x = self._input(hidden, prev_ids)  # (B, M, D)
            cos, sin = self._rope(anchor_positions + k - 2)  # (B, M, hd)
            mask = torch.cat([mask, own], dim=-1)  # (B, M, L + (k-1)·M): real < a, own block's steps 2..k
            hidden, k_new, v_new = self.layer(x, cos[:, None], sin[:, None], past_k, past_v, mask[:, None])
            past_k, past_v = torch.cat([past_k, k_new], dim=2), torch.cat([past_v, v_new], dim=2)
            steps.append(hidden)
        logits = self._logits(torch.stack(steps, dim=2))  # (B, M, γ, N)

        block_pos = anchor_positions[:, :, None] + torch.arange(gamma, device=dev)  # (B, M, γ)
        lens = torch.full((b,), seq_len, device=dev) if seq_lens is None else seq_lens.to(dev)
        is_valid = (block_pos + 1 < lens[:, None, None]) & (anchor_positions >= 1)[:, :, None]
        if is_anchor_valid is not None:
            is_valid = is_valid & is_anchor_valid[:, :, None]
        labels = token_ids[:, None, :].expand(b, m, seq_len).gather(2, (block_pos + 1).clamp(max=seq_len - 1))
        draft_labels = self.target_to_draft[labels]
        is_in_vocab = draft_labels < self.config.draft_vocab_size
        return DSparkTrainOutput(
            logits=logits, confidence_logits=None, is_valid=is_valid, labels=labels,
            draft_labels=torch.where(is_in_vocab, draft_labels, 0), is_label_in_draft_vocab=is_in_vocab)

    # ---- inference -----------------------------------------------------------------------------------
    def plan_gemm(self, cache_root: Path | None) -> DraftGemm:
        """Run this model's GEMMs at inference on the kernels measured fastest here (see draft_gemm.py).
        Forwards with autograd on (training) keep F.linear; call after `attach_target` and `.to(device)`."""
        self._check_attached()
        sources: Sources = {"head": (lambda: self.draft_lm_head, same), "in_proj": (lambda: self.in_proj.weight, same),
                            **layer_sources("layer", self.layer), **self._feature_encoder_sources()}
        return attach_gemm(self, sources, cache_root)

    @torch.no_grad()
    def draft(self, past_kv: torch.Tensor | None, past_lens: torch.Tensor, pending_features: torch.Tensor,
              pending_ids: torch.Tensor, pending_lens: torch.Tensor, temperatures: torch.Tensor | None = None,
              num_tokens: int | None = None, generator: torch.Generator | None = None) -> ARDraftBlock:
        """One draft round for R requests: the pending real positions, then draft steps left to right.

        past_kv (2, R, Hkv, Lp, hd): cached K/V of real positions 0..past_lens[r]-1 (padded; None if Lp = 0);
        pending_features (R, P, taps*D_t) of positions past_lens[r] + i, i < pending_lens[r] (≥ 1; padded);
        pending_ids (R, P): the token x_{j+1} that follows each pending position j; its last real entry is the
        anchor. temperatures (R,): T > 0 samples softmax(logits / T), 0 takes the argmax (a point mass in
        `probs`); None = every request greedy, `probs` is None. num_tokens k ≤ γ (default γ).
        """
        self._check_attached()
        gamma = self.config.block_size
        k_out = gamma if num_tokens is None else min(num_tokens, gamma)
        num_req, num_pending = pending_ids.shape
        dev = pending_ids.device
        past_len = 0 if past_kv is None else past_kv.shape[-2]
        sees_past = torch.arange(past_len, device=dev) < past_lens[:, None]  # (R, Lp)
        causal = torch.ones(num_pending, num_pending, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([sees_past[:, None].expand(num_req, num_pending, past_len),
                          causal.expand(num_req, num_pending, num_pending)], dim=-1)  # (R, P, Lp + P)
        positions = past_lens[:, None] + torch.arange(num_pending, device=dev)  # (R, P)
        cos, sin = self._rope(positions)
        x = self._input(self.encode_features(pending_features), pending_ids)  # (R, P, D)
        past_k, past_v = (None, None) if past_kv is None else (past_kv[0], past_kv[1])
        real, k_new, v_new = self.layer(x, cos[:, None], sin[:, None], past_k, past_v, mask[:, None])
        hidden = real.gather(1, (pending_lens - 1)[:, None, None].expand(num_req, 1, real.shape[-1]))[:, 0]
        # keys of later steps: past + valid pending positions + earlier draft steps
        keys_k = k_new if past_k is None else torch.cat([past_k, k_new], dim=2)
        keys_v = v_new if past_v is None else torch.cat([past_v, v_new], dim=2)
        sees = torch.cat([sees_past, torch.arange(num_pending, device=dev) < pending_lens[:, None]], dim=-1)
        anchor_pos = past_lens + pending_lens  # (R,) position of the anchor token

        is_sampled = temperatures is not None  # decided by the caller on the host: no sync here
        if is_sampled:
            is_greedy = (temperatures <= 0)[:, None]  # (R, 1)
            inv_temp = 1.0 / torch.where(is_greedy, torch.ones_like(temperatures[:, None]), temperatures[:, None])
            uniforms = torch.rand(num_req, k_out, generator=generator, device=dev)  # (R, k)
        ids, logits, probs = [], [], []
        for step in range(k_out):
            if step > 0:  # feed back the previous output as the feature, with the previous draft token
                x = self._input(hidden, self.draft_to_target[ids[-1]])[:, None]  # (R, 1, D)
                cos, sin = self._rope(anchor_pos + step - 1)  # (R, hd)
                sees = torch.cat([sees, sees.new_ones(num_req, 1)], dim=-1)
                out, k_step, v_step = self.layer(x, cos[:, None, None], sin[:, None, None], keys_k, keys_v,
                                                 sees[:, None, None])
                hidden = out[:, 0]
                keys_k, keys_v = torch.cat([keys_k, k_step], dim=2), torch.cat([keys_v, v_step], dim=2)
            logit = self._head(self.norm(hidden), self.draft_lm_head)  # (R, N)
            if is_sampled:
                tok, p = sample_draft_token(logit, is_greedy, inv_temp, uniforms[:, step:step + 1])
                probs.append(p)
            else:
                tok = logit.argmax(dim=-1)
            ids.append(tok)
            logits.append(logit)
        return ARDraftBlock(draft_ids=torch.stack(ids, dim=1), logits=torch.stack(logits, dim=1),
                            probs=torch.stack(probs, dim=1) if is_sampled else None,
                            new_kv=torch.stack([k_new, v_new]))

    # ---- checkpoints -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json + model.safetensors (weights and draft_to_target; no target weights)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.config.save(out / "config.json")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(out / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> Self:
        """Load a checkpoint written by `save_pretrained`; call `attach_target` afterwards."""
        src = Path(path)
        model = cls(cls.config_class.load(src / "config.json"))
        model.load_state_dict(load_file(str(src / "model.safetensors")))
        return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
