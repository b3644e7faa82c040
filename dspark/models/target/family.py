"""What sets one decoder family apart from Llama, in one place: its layer math and its weight names.

The flattened runner (`runner.py`, `native_forward.py`) is one forward for every family here; it reads a
`Family` (which norms, activation, scales, windows, MoE) and the `LayerWeights` that `layer_weights` pulls
out of the HF module by the family's names. A causal LM whose architecture has no description here (or
whose config asks for something a description does not cover, `unsupported_reason`) runs on the generic
transformers path (`generic_runner.py`) instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspark.kernels.gemm_plan import PlannedLinear
from dspark.models.target.moe import SparseMoE

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class Family:
    """A decoder family: Llama's pre-norm block plus the differences its flags name."""

    name: str
    architectures: tuple[str, ...]
    qkv_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # under self_attn; one name: fused q|k|v
    gate_up_names: tuple[str, ...] = ("gate_proj", "up_proj")  # under mlp; one name: fused gate|up
    has_qk_norm: bool = False  # RMSNorm over each head's q and k before the rotary (Qwen3, Gemma 3)
    has_sandwich_norms: bool = False  # Gemma 3: norm on the attention and MLP outputs, pre-MLP norm by name
    norm_offset: float = 0.0  # Gemma: x̂ · (1 + w), computed in fp32
    scales_embeddings: bool = False  # Gemma: embeddings × √D (in the weights' dtype)
    rotary_per_layer_type: bool = False  # Gemma 3: local (sliding) layers have their own RoPE base
    is_moe: bool = False  # Qwen3-MoE: top-k experts in place of the MLP (every decoder_sparse_step-th layer)
    # Gemma 3's config carries attn_logit_softcapping, but its HF attention never applies it (Gemma 2's did):
    # neither do we. Its final_logit_softcapping is applied (runner.logits).


LLAMA = Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"))
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), has_qk_norm=True)
QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), has_qk_norm=True, is_moe=True)
PHI3 = Family("phi3", ("Phi3ForCausalLM",), qkv_names=("qkv_proj",), gate_up_names=("gate_up_proj",))
GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",), has_qk_norm=True, has_sandwich_norms=True, norm_offset=1.0,
                scales_embeddings=True, rotary_per_layer_type=True)
FAMILIES = (LLAMA, QWEN3, QWEN3_MOE, PHI3, GEMMA3)


def architecture_of(model: torch.nn.Module) -> str:
    return (getattr(model.config, "architectures", None) or [type(model).__name__])[0]


def family_of(model: torch.nn.Module) -> Family | None:
    """The native description of this model's architecture (its class name first), or None."""
    for name in (type(model).__name__, architecture_of(model)):
        for family in FAMILIES:
            if name in family.architectures:
                return family
    return None


def unsupported_reason(family: Family, cfg: Any) -> str | None:
    """Why this config needs more than its family's description says (None: the native runner takes it)."""
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"activation {act!r} (native: {', '.join(ACTIVATIONS)})"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if family.is_moe and getattr(cfg, "shared_expert_intermediate_size", 0):
        return "shared experts"
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return f"pretraining_tp={cfg.pretraining_tp}"
    return None


def activation_of(cfg: Any) -> str:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    return "silu" if act == "silu" else "gelu_tanh"


def query_scale(cfg: Any, head_dim: int) -> float:
    """Softmax scale of q·k: Gemma's 1/√query_pre_attn_scalar, else 1/√head_dim."""
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    return float(scalar) ** -0.5 if scalar else head_dim ** -0.5


def layer_windows(cfg: Any) -> list[int | None]:
    """Keys each layer attends to at most (its sliding window), None for full attention. Configs with
    `layer_types` window only their "sliding_attention" layers (Qwen2/3, Gemma 3); the others (Mistral, Phi-3,
    Qwen3-MoE) window every layer when `sliding_window` is set, as their HF modules do."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window:
        return [None] * cfg.num_hidden_layers
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * cfg.num_hidden_layers


@dataclass
class LayerWeights:
    """One decoder layer's weights as the runner uses them: q|k|v and gate|up fused, norms with their
    family offset folded in (Gemma's 1 + w, kept in fp32)."""

    in_norm: torch.Tensor
    qkv: PlannedLinear
    o: PlannedLinear
    post_norm: torch.Tensor  # the pre-MLP norm
    gate_up: PlannedLinear | None  # None where `moe` replaces the MLP
    down: PlannedLinear | None
    q_norm: torch.Tensor | None = None  # (head_dim,) per-head norms
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma 3: on the attention output, before the residual
    mlp_out_norm: torch.Tensor | None = None  # Gemma 3: on the MLP output, before the residual
    moe: SparseMoE | None = None
    window: int | None = None  # sliding window (keys), None: full attention
    rotary_key: str | None = None  # which rotary table the layer takes (Gemma 3: its layer type)


def _norm_weight(family: Family, module: torch.nn.Module) -> torch.Tensor:
    w = module.weight.detach()
    return (w.float() + family.norm_offset) if family.norm_offset else w.contiguous()


def _cat(module: torch.nn.Module, names: tuple[str, ...]) -> PlannedLinear:
    parts = [getattr(module, n) for n in names]
    weight = torch.cat([p.weight for p in parts]) if len(parts) > 1 else parts[0].weight
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else p.weight.new_zeros(p.weight.shape[0])
                          for b, p in zip(biases, parts)]) if len(parts) > 1 else biases[0]
    return PlannedLinear(weight, bias)


def layer_weights(family: Family, layer: torch.nn.Module, index: int, cfg: Any) -> LayerWeights:
    """Pull layer `index`'s weights out of its HF module by the family's names."""
    attn, mlp = layer.self_attn, layer.mlp
    types = getattr(cfg, "layer_types", None)
    lw = LayerWeights(
        in_norm=_norm_weight(family, layer.input_layernorm),
        qkv=_cat(attn, family.qkv_names),
        o=PlannedLinear(attn.o_proj.weight, attn.o_proj.bias),
        post_norm=_norm_weight(family, layer.pre_feedforward_layernorm if family.has_sandwich_norms
                               else layer.post_attention_layernorm),
        gate_up=None, down=None,
        window=layer_windows(cfg)[index],
        rotary_key=types[index] if family.rotary_per_layer_type and types is not None else None,
    )
    if family.has_qk_norm:
        lw.q_norm, lw.k_norm = _norm_weight(family, attn.q_norm), _norm_weight(family, attn.k_norm)
    if family.has_sandwich_norms:
        lw.attn_out_norm = _norm_weight(family, layer.post_attention_layernorm)
        lw.mlp_out_norm = _norm_weight(family, layer.post_feedforward_layernorm)
    if family.is_moe and hasattr(mlp, "experts"):
        lw.moe = SparseMoE.from_hf(mlp, cfg, activation_of(cfg))
    else:
        lw.gate_up = _cat(mlp, family.gate_up_names)
        lw.down = PlannedLinear(mlp.down_proj.weight, mlp.down_proj.bias)
    return lw


def is_plain_llama(family: Family, layers: list[LayerWeights], cfg: Any, rotary_dim: int, head_dim: int) -> bool:
    """Whether every layer is Llama's math (what the one-call native decoder stack computes)."""
    return (family.norm_offset == 0.0 and not family.has_qk_norm and not family.has_sandwich_norms
            and not family.scales_embeddings and activation_of(cfg) == "silu" and rotary_dim == head_dim
            and all(ly.moe is None and ly.window is None for ly in layers))


def decoder_layer_weights(model: torch.nn.Module, index: int) -> LayerWeights:
    """Decoder layer `index` of a described family's HF causal LM as `LayerWeights`:
    what drafters copy when they start from the target's layers."""
    family = family_of(model)
    if family is None:
        raise ValueError(f"starting a drafter from the target's layers needs a family description of "
                         f"{architecture_of(model)} (family.py); train it from random weights (init_from_target: "
                         f"false)")
    return layer_weights(family, model.model.layers[index], index, model.config)


def final_norm_weight(model: torch.nn.Module) -> torch.Tensor:
    """The final norm's weight as a plain RMSNorm weight (Gemma's 1 + w folded in)."""
    return _norm_weight(family_of(model) or LLAMA, model.model.norm)
