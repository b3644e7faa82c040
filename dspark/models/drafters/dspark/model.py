"""The DSpark draft model: a DFlash-style parallel backbone plus a light sequential head (paper §3.1).

Context: the target's hidden states of the tapped layers, concatenated, go through `fc` + RMSNorm and are
injected as extra keys/values into EVERY draft layer. The block [emb(x0), mask, ..., mask] (γ positions,
bidirectional) attends to the context before the anchor x0 and to itself; position k (0-based) predicts
x_{k+1}. Base logits U_k come from the target's frozen LM head restricted to a draft vocabulary of N
tokens; the sequential head adds a prefix-dependent bias B_k, and the confidence head estimates
P(x_k accepted | x_<k accepted). The frozen target embedding and LM head are attached, never saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.models.drafters.draft_gemm import DraftGemm, GemmPlanned, Sources, attach_gemm, layer_sources, same
from dspark.models.drafters.dspark.config import DSparkConfig
from dspark.models.drafters.target_tied import TargetTiedMixin
from dspark.models.target.family import decoder_layer_weights, final_norm_weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF Llama convention (rotate_half); cos/sin broadcast against x (..., hd)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass
class DSparkTrainOutput:
    """Teacher-forced outputs over packed blocks: B sequences, M anchors each, γ positions per block."""

    logits: torch.Tensor  # (B, M, γ, N) draft-vocab logits, base + sequential bias
    confidence_logits: torch.Tensor | None  # (B, M, γ) pre-sigmoid; None without a confidence head
    is_valid: torch.Tensor  # (B, M, γ) bool: the target token exists (inside the sequence, valid anchor)
    labels: torch.Tensor  # (B, M, γ) long: ground-truth target-vocab token x*_k (clamped where invalid)
    draft_labels: torch.Tensor  # (B, M, γ) long: x*_k in the draft vocab (0 where not in it)
    is_label_in_draft_vocab: torch.Tensor  # (B, M, γ) bool


@dataclass
class DraftBlock:
    """One inference round for R requests: k ≤ γ draft tokens each, in draft-vocab ids."""

    draft_ids: torch.Tensor  # (R, k) long
    logits: torch.Tensor  # (R, k, N) base + sequential bias, before temperature
    probs: torch.Tensor | None  # (R, k, N) the distribution each token was drawn from; None if all greedy
    confidences: torch.Tensor | None  # (R, k) σ(logit / T_k) with STS temperatures applied


class _DecoderLayer(GemmPlanned, nn.Module):
    """Pre-norm attention + SwiGLU MLP whose keys/values are [projected context ; block]."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.input_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=False)  # fused q|k|v
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.post_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)  # fused gate|up
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx (..., n, D) normed context hidden -> K (with RoPE), V each (..., Hkv, n, hd)."""
        kv = self._linear("kv", ctx, self.qkv_proj.weight[self.num_heads * self.head_dim:])
        kv = kv.unflatten(-1, (2 * self.num_kv_heads, self.head_dim)).transpose(-2, -3)  # (..., 2Hkv, n, hd)
        k, v = kv.split(self.num_kv_heads, dim=-3)
        return _rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, Q, D) block hidden; cos/sin (B, 1, Q, hd); ctx_k/v (B, Hkv, L, hd); mask (B, 1, Q, L+Q)."""
        h = self.input_norm(x)
        qkv = self._linear("qkv", h, self.qkv_proj.weight).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # (B, Hkv, L+Q, hd)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (B, H, Q, hd)
        x = x + self._linear("o", attn.transpose(1, 2).flatten(2), self.o_proj.weight)
        gate, up = self._linear("gate_up", self.post_norm(x), self.gate_up_proj.weight).chunk(2, dim=-1)
        return x + self._linear("down", F.silu(gate) * up, self.down_proj.weight)


class DSparkModel(GemmPlanned, TargetTiedMixin, nn.Module):
    """The DSpark drafter's trainable part; call `attach_target` before any forward."""

    def __init__(self, config: DSparkConfig, draft_to_target: torch.Tensor | None = None) -> None:
        super().__init__()
        cfg = self.config = config
        d, n, r = cfg.hidden_size, cfg.draft_vocab_size, cfg.markov_rank
        self.fc = nn.Linear(cfg.num_context_features, d, bias=False)
        self.context_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(_DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.has_prev_embedding = cfg.head_type != "none"
        if self.has_prev_embedding:
            self.prev_embedding = nn.Embedding(n + 1, r)  # W1; row N = previous token outside the draft vocab
            # W2 (r, N) as in eq. 5, stored so that W1[x] @ W2 reads it row-major: 5-7x faster for one row
            self.transition = nn.Parameter(torch.zeros(r, n))
        if cfg.head_type == "rnn":
            self.rnn_proj = nn.Linear(2 * r + d, 3 * r)  # [s; W1[x]; h] -> gate | candidate | output
        if cfg.use_confidence:
            self.confidence_head = nn.Linear(d + (r if self.has_prev_embedding else 0), 1)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("draft_to_target", torch.arange(n), persistent=True)  # (N,) saved with the weights
        self.register_buffer("target_to_draft", torch.zeros(cfg.target_vocab_size, dtype=torch.long),
                             persistent=False)  # (V_t,) N for tokens outside the draft vocab
        self.register_buffer("target_embed", None, persistent=False)  # (V_t, D) frozen, attached
        self.register_buffer("draft_lm_head", None, persistent=False)  # (N, D) target_lm_head[draft_to_target]
        self._target_lm_head: torch.Tensor | None = None
        self._init_weights()
        self.set_draft_vocab(draft_to_target if draft_to_target is not None else torch.arange(n))
        self.register_load_state_dict_post_hook(lambda module, _keys: module._rebuild_vocab_maps())

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.mask_embedding, std=0.02)
        if self.has_prev_embedding:
            nn.init.zeros_(self.transition)  # B = 0: training starts from the parallel model

    @torch.no_grad()
    def init_from_target(self, target_model: nn.Module) -> list[int]:
        """Start from the target's top decoder layers instead of random weights (any family `family.py` describes).

        Draft layer i copies target layer L - num_layers + i (norms, attention, MLP) and the final norm;
        `fc` starts by passing the highest tapped feature through, with the first copied layer's input norm
        as `context_norm`, so the context keys/values begin as that layer computes them. Returns the
        target layer indices copied.
        """
        layers = target_model.model.layers
        cfg = self.config
        if len(layers) < cfg.num_layers:
            raise ValueError(f"target has {len(layers)} layers, the drafter wants {cfg.num_layers}")
        first = len(layers) - cfg.num_layers
        for i, mine in enumerate(self.layers):
            theirs = decoder_layer_weights(target_model, first + i)  # any family's names (family.py)
            pairs = [(mine.qkv_proj.weight, theirs.qkv.weight), (mine.o_proj.weight, theirs.o.weight),
                     (mine.input_norm.weight, theirs.in_norm), (mine.post_norm.weight, theirs.post_norm)]
            if theirs.gate_up is not None:  # a sparse-expert layer keeps the draft MLP's random init
                pairs += [(mine.gate_up_proj.weight, theirs.gate_up.weight),
                          (mine.down_proj.weight, theirs.down.weight)]
            for dst, src in pairs:
                if dst.shape != src.shape:
                    raise ValueError(f"target layer shape {tuple(src.shape)} != draft {tuple(dst.shape)}")
                dst.copy_(src)
        self.norm.weight.copy_(final_norm_weight(target_model))
        self.context_norm.weight.copy_(decoder_layer_weights(target_model, first).in_norm)
        d = cfg.hidden_size
        self.fc.weight.mul_(0.1)
        self.fc.weight[:, -d:] += torch.eye(d, dtype=self.fc.weight.dtype)
        return list(range(first, len(layers)))

    # ---- vocabulary and frozen target weights ------------------------------------------------------
    def _reference_weight(self) -> torch.Tensor:
        return self.fc.weight

    # ---- sequential + confidence heads (shared by training and inference) -------------------------
    def _prev_embed(self, prev: torch.Tensor) -> torch.Tensor | None:
        return self.prev_embedding(prev) if self.has_prev_embedding else None  # (..., r)

    def _rnn_step(self, state: torch.Tensor, e: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Paper eq. 6: state (..., r), e = W1[x_{k-1}] (..., r), h (..., D) -> new state, bias (..., N)."""
        gate, cand, out = F.linear(torch.cat([state, e, h], dim=-1), self.rnn_proj.weight,
                                   self.rnn_proj.bias).chunk(3, dim=-1)
        g = torch.sigmoid(gate)
        state = g * state + (1 - g) * torch.tanh(cand)
        return state, torch.tanh(out) @ self.transition

    def _confidence_logit(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor | None:
        if not self.config.use_confidence:
            return None
        z = h if e is None else torch.cat([h, e], dim=-1)
        return F.linear(z, self.confidence_head.weight, self.confidence_head.bias).squeeze(-1)

    def confidences(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """(..., k) logits -> c_k = σ(logit / T_k), with the config's STS temperatures if set."""
        temps = self.config.sts_temperatures
        if temps is None:
            return torch.sigmoid(confidence_logits)
        k = confidence_logits.shape[-1]
        t = torch.tensor(temps[:k], dtype=confidence_logits.dtype, device=confidence_logits.device)
        return torch.sigmoid(confidence_logits / t)

    # ---- backbone ------------------------------------------------------------------------------------
    def plan_gemm(self, cache_root: Path | None) -> DraftGemm:
        """Run this model's GEMMs at inference on the kernels measured fastest here (see draft_gemm.py).
        Forwards with autograd on (training) keep F.linear; call after `attach_target` and `.to(device)`."""
        self._check_attached()
        sources: Sources = {"head": (lambda: self.draft_lm_head, same), "fc": (lambda: self.fc.weight, same)}
        if self.has_prev_embedding:
            sources["transition"] = (lambda: self.transition, lambda t: t.t())
        for i, layer in enumerate(self.layers):
            kv_rows = layer.num_heads * layer.head_dim
            sources.update(layer_sources(f"layers.{i}", layer))
            sources[f"layers.{i}.kv"] = (lambda ly=layer: ly.qkv_proj.weight, lambda t, n=kv_rows: t[n:])
        return attach_gemm(self, sources, cache_root)

    def encode_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (..., taps*D_t) -> context hidden (..., D)."""
        return self.context_norm(self._linear("fc", features.to(self.fc.weight.dtype), self.fc.weight))

    def context_kv(self, features: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Features (n, taps*D_t) of positions start_pos.. -> (num_layers, 2, Hkv, n, hd) K (RoPE'd) and V."""
        ctx = self.encode_context(features)  # (n, D)
        cos, sin = self._rope(torch.arange(start_pos, start_pos + ctx.shape[0], device=ctx.device))
        return torch.stack([torch.stack(layer.context_kv(ctx, cos, sin)) for layer in self.layers])

    def _block_input(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor_ids (...,) -> (..., γ, D): [emb(x0), mask, ..., mask]."""
        anchor = self.target_embed[anchor_ids].unsqueeze(-2)
        masks = self.mask_embedding.expand(*anchor_ids.shape, self.config.block_size - 1, -1)
        return torch.cat([anchor, masks], dim=-2)

    def forward_train(self, features: torch.Tensor, token_ids: torch.Tensor, anchor_positions: torch.Tensor,
                      seq_lens: torch.Tensor | None = None,
                      is_anchor_valid: torch.Tensor | None = None) -> DSparkTrainOutput:
        """Teacher-forced forward over M packed blocks per sequence, all at once.

        features (B, L, taps*D_t): target features of every position; token_ids (B, L); anchor_positions
        (B, M) long; seq_lens (B,) real lengths (default L); is_anchor_valid (B, M) bool (default all).
        Block m sees context positions < anchor_positions[:, m] and its own γ positions (bidirectional).
        """
        self._check_attached()
        cfg, gamma = self.config, self.config.block_size
        (b, seq_len, _), m = features.shape, anchor_positions.shape[1]
        dev = features.device
        offsets = torch.arange(gamma, device=dev)
        block_pos = anchor_positions[:, :, None] + offsets  # (B, M, γ)
        ctx = self.encode_context(features)  # (B, L, D)
        x = self._block_input(token_ids.gather(1, anchor_positions)).flatten(1, 2)  # (B, M·γ, D)
        num_q = m * gamma
        sees_ctx = torch.arange(seq_len, device=dev) < anchor_positions[:, :, None]  # (B, M, L)
        sees_ctx = sees_ctx[:, :, None].expand(b, m, gamma, seq_len).reshape(b, num_q, seq_len)
        block_of = torch.arange(num_q, device=dev) // gamma
        sees_block = (block_of[:, None] == block_of[None, :]).expand(b, num_q, num_q)
        mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]  # (B, 1, M·γ, L + M·γ)
        cos_c, sin_c = self._rope(torch.arange(seq_len, device=dev))  # (L, hd)
        cos_b, sin_b = self._rope(block_pos.flatten(1))  # (B, M·γ, hd)
        cos_b, sin_b = cos_b[:, None], sin_b[:, None]
        for layer in self.layers:
            ctx_k, ctx_v = layer.context_kv(ctx, cos_c, sin_c)  # (B, Hkv, L, hd)
            x = layer(x, cos_b, sin_b, ctx_k, ctx_v, mask)
        h = self.norm(x).view(b, m, gamma, -1)  # (B, M, γ, D)
        logits = F.linear(h, self.draft_lm_head)  # (B, M, γ, N) base logits U_k

        lens = torch.full((b,), seq_len, device=dev) if seq_lens is None else seq_lens.to(dev)
        is_valid = block_pos + 1 < lens[:, None, None]
        if is_anchor_valid is not None:
            is_valid = is_valid & is_anchor_valid[:, :, None]
        flat_ids = token_ids[:, None, :].expand(b, m, seq_len)
        labels = flat_ids.gather(2, (block_pos + 1).clamp(max=seq_len - 1))  # x*_1..x*_γ
        prev = flat_ids.gather(2, block_pos.clamp(max=seq_len - 1))  # teacher forcing: x*_0..x*_{γ-1}
        e = self._prev_embed(self.target_to_draft[prev])  # (B, M, γ, r)
        if cfg.head_type == "markov":
            logits = logits + e @ self.transition
        elif cfg.head_type == "rnn":
            state = e.new_zeros(e.shape[:-2] + (cfg.markov_rank,))
            biases = []
            for k in range(gamma):
                state, bias = self._rnn_step(state, e[..., k, :], h[..., k, :])
                biases.append(bias)
            logits = logits + torch.stack(biases, dim=-2)
        draft_labels = self.target_to_draft[labels]
        is_in_vocab = draft_labels < cfg.draft_vocab_size
        return DSparkTrainOutput(
            logits=logits, confidence_logits=self._confidence_logit(h, e), is_valid=is_valid, labels=labels,
            draft_labels=torch.where(is_in_vocab, draft_labels, 0), is_label_in_draft_vocab=is_in_vocab)

    @torch.no_grad()
    def draft(self, context_kv: torch.Tensor, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
              context_lens: torch.Tensor | None = None, temperatures: torch.Tensor | None = None,
              num_tokens: int | None = None, generator: torch.Generator | None = None) -> DraftBlock:
        """One draft round for R requests: a batched backbone pass, then the sequential head left to right.

        context_kv (num_layers, 2, R, Hkv, L, hd): each request's context K/V (from `context_kv`), padded to L;
        context_lens (R,) real lengths (None: all L); anchor_ids (R,) target ids; anchor_positions (R,);
        temperatures (R,): T > 0 samples softmax(logits / T), 0 takes the argmax (a point mass in `probs`);
        None = every request greedy, `probs` is None. num_tokens k ≤ γ (default γ).
        """
        self._check_attached()
        gamma = self.config.block_size
        k_out = gamma if num_tokens is None else min(num_tokens, gamma)
        num_req, dev = anchor_ids.shape[0], anchor_ids.device
        x = self._block_input(anchor_ids)  # (R, γ, D)
        cos, sin = self._rope(anchor_positions[:, None] + torch.arange(gamma, device=dev))  # (R, γ, hd)
        cos, sin = cos[:, None], sin[:, None]
        mask = None
        if context_lens is not None:
            sees_ctx = torch.arange(context_kv.shape[-2], device=dev) < context_lens[:, None]  # (R, L)
            mask = torch.cat([sees_ctx, sees_ctx.new_ones(num_req, gamma)], dim=-1)[:, None, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, context_kv[i, 0], context_kv[i, 1], mask)
        h = self.norm(x[:, :k_out])  # (R, k, D)
        base = self._head(h.flatten(0, 1), self.draft_lm_head).view(num_req, k_out, -1)  # (R, k, N)
        is_sampled = temperatures is not None  # decided by the caller on the host: no sync here
        if is_sampled:
            is_greedy = (temperatures <= 0)[:, None]  # (R, 1)
            inv_temp = 1.0 / torch.where(is_greedy, torch.ones_like(temperatures[:, None]), temperatures[:, None])
            uniforms = torch.rand(num_req, k_out, generator=generator, device=dev)  # (R, k)
        prev = self.target_to_draft[anchor_ids]  # (R,) x0 in the draft vocab (N if outside)
        state = h.new_zeros(num_req, self.config.markov_rank) if self.config.head_type == "rnn" else None
        ids, logits, probs, prev_embeds = [], [], [], []
        for k in range(k_out):
            e = self._prev_embed(prev)
            logit = base[:, k]
            if self.config.head_type == "markov":
                logit = logit + self._linear("transition", e, self.transition.t())  # e @ W2
            elif state is not None:
                state, bias = self._rnn_step(state, e, h[:, k])
                logit = logit + bias
            tok = logit.argmax(dim=-1)
            if is_sampled:
                p = torch.softmax(logit * inv_temp, dim=-1)  # (R, N)
                # inverse-CDF sampling (cheaper than multinomial's exponential race); right=True lands on a
                # strict CDF jump, so a zero-probability token is never drawn
                cdf = p.cumsum(dim=-1)
                sampled = torch.searchsorted(cdf, uniforms[:, k:k + 1] * cdf[:, -1:], right=True).squeeze(-1)
                sampled = sampled.clamp_max(p.shape[-1] - 1)
                tok = torch.where(is_greedy[:, 0], tok, sampled)
                p = torch.where(is_greedy, F.one_hot(tok, p.shape[-1]).to(p.dtype), p)
                probs.append(p)
            prev_embeds.append(e)
            ids.append(tok)
            logits.append(logit)
            prev = tok
        # c_k depends on x_{k-1} only, so every position is scored in one call after the loop
        e_all = torch.stack(prev_embeds, dim=1) if self.has_prev_embedding else None  # (R, k, r)
        conf_logits = self._confidence_logit(h, e_all)  # (R, k)
        return DraftBlock(draft_ids=torch.stack(ids, dim=1), logits=torch.stack(logits, dim=1),
                          probs=torch.stack(probs, dim=1) if is_sampled else None,
                          confidences=None if conf_logits is None else self.confidences(conf_logits))

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
                        dtype: torch.dtype | None = None) -> DSparkModel:
        """Load a checkpoint written by `save_pretrained`; call `attach_target` afterwards."""
        src = Path(path)
        model = cls(DSparkConfig.load(src / "config.json"))
        model.load_state_dict(load_file(str(src / "model.safetensors")))
        return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
