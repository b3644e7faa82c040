"""Tiny random targets of each family (hidden 64, 2 layers), built from a config with `AutoConfig.for_model` and
saved as Hugging Face folders with a given tokenizer: the families the runner describes natively (family.py) and
two that only the generic path runs. What a new user tries first; what the family tests, `dspark profile` per
family and the generic-path benchmark run on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dspark.models.target.loader import resolve_target_path

WINDOW = 8  # sliding window of the windowed families: the tests' prompts are longer
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict()),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1])),  # one sparse, one dense layer
    "qwen3_moe_window": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           sliding_window=WINDOW, use_sliding_window=True)),
    "gemma3": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0,
                                   rope_local_base_freq=100.0)),
    "gemma3_attn_softcap": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                                layer_types=["sliding_attention", "full_attention"],
                                                attn_logit_softcapping=2.0)),
    "phi3": ("phi3", dict()),
    "phi3_partial_rotary": ("phi3", dict(partial_rotary_factor=0.5)),
    "llama3_rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral_window": ("mistral", dict(sliding_window=WINDOW)),
    # no native description: the generic transformers path
    "olmo2": ("olmo2", dict()),
    "granite": ("granite", dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                logits_scaling=2.0)),
}
NATIVE = ("llama", "qwen3", "qwen3_moe", "qwen3_moe_window", "gemma3", "gemma3_attn_softcap", "phi3",
          "phi3_partial_rotary", "llama3_rope", "mistral_window")
GENERIC = ("olmo2", "granite")


def make_family_dir(kind: str, out: Path, tokenizer: str | Path, seed: int = 0, hidden_size: int = 64,
                    num_layers: int = 2) -> Path:
    """A random `kind` model (FAMILY_CONFIGS) with the tokenizer of `tokenizer` (a HF folder or the embedded
    default's name), saved to `out` (safetensors, config.json, the tokenizer)."""
    if kind not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {kind!r}; expected one of {', '.join(FAMILY_CONFIGS)}")
    model_type, extra = FAMILY_CONFIGS[kind]
    tok = AutoTokenizer.from_pretrained(resolve_target_path(str(tokenizer)))
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), hidden_size=hidden_size,
                               intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.15,
                               tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                               bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, **extra)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms away from their init (so Gemma's 1 + w matters), sharper logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        model.get_output_embeddings().weight.mul_(2.0)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return Path(out)
