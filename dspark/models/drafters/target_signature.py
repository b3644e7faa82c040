"""Which target a drafter was built for, and the refusal (with its reason) to load it against another.

A drafter reads the target's hidden states at fixed layers and shares its embedding and LM head: against
another target it would at best draft nonsense (lossless, but every draft rejected) and at worst fail on a
shape deep inside a forward. `dspark train` records the target's signature in the drafter's config
(`from_target`); loading compares it with the target at hand before anything runs.
"""

from __future__ import annotations

from typing import Any

SIGNATURE_KEYS = ("architecture", "model_type", "hidden_size", "num_hidden_layers", "vocab_size")


def text_config(config: Any) -> Any:
    """The decoder's config (a multimodal wrapper's text config; the config itself otherwise)."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def signature_of(config: Any) -> dict[str, Any]:
    """What identifies a target for a drafter: architecture and the sizes the drafter is built on."""
    cfg = text_config(config)
    return {"architecture": (getattr(config, "architectures", None) or [""])[0],
            "model_type": getattr(cfg, "model_type", ""), "hidden_size": int(cfg.hidden_size),
            "num_hidden_layers": int(cfg.num_hidden_layers), "vocab_size": int(cfg.vocab_size)}


def mismatch(drafter_config: Any, target_config: Any) -> str | None:
    """Why a drafter with this config cannot run against this target (None: it can). Checkpoints written
    before signatures were recorded are checked on the sizes their config holds."""
    have = signature_of(target_config)
    reasons = []
    wanted = getattr(drafter_config, "target", None) or {}
    for key in SIGNATURE_KEYS:
        if key in wanted and wanted[key] != have[key]:
            reasons.append(f"{key} {wanted[key]!r} (the target has {have[key]!r})")
    if not wanted:
        for key, mine in (("hidden_size", drafter_config.target_hidden_size),
                          ("vocab_size", drafter_config.target_vocab_size)):
            if mine != have[key]:
                reasons.append(f"{key} {mine} (the target has {have[key]})")
    if max(drafter_config.target_layers) > have["num_hidden_layers"]:
        reasons.append(f"tapped layers {drafter_config.target_layers} (the target has "
                       f"{have['num_hidden_layers']} layers)")
    if not reasons:
        return None
    return "the drafter was built for another target: " + "; ".join(reasons)


def check(drafter_config: Any, target_config: Any, drafter_path: object = "") -> None:
    """Raise ValueError with the reason if the drafter does not belong to this target."""
    reason = mismatch(drafter_config, target_config)
    if reason is not None:
        where = f" {drafter_path}" if drafter_path else ""
        raise ValueError(f"refusing to load the drafter{where}: {reason}")
