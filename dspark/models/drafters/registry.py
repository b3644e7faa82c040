"""The drafter registry: a drafter kind by name, from its checkpoint folder. It sits above every kind, which it
imports only when asked for (a process that serves n-grams never loads the neural drafters)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dspark.models.drafters.base import DEFAULT_CHECKPOINTS, Drafter

if TYPE_CHECKING:
    from dspark.models.target.loader import TargetModel

DRAFTER_NAMES = ("none", "ngram", "suffix", "hybrid", "oracle", "dspark", "dflash", "eagle3", "mtp1")


def make_drafter(name: str, target: TargetModel, **kwargs: object) -> Drafter | None:
    """Build a drafter by name; "none" means target-only decoding (returns None).

    The trained drafters ("dspark", "dflash", "eagle3", "mtp1") load a checkpoint folder: `path=...`, by
    default checkpoints/<name>-smollm2.
    """
    if name == "none":
        return None
    if name == "ngram":
        from dspark.models.drafters.ngram import NgramDrafter

        return NgramDrafter(**kwargs)  # type: ignore[arg-type]
    if name == "oracle":
        from dspark.models.drafters.oracle import OracleDrafter

        return OracleDrafter(target, **kwargs)  # type: ignore[arg-type]
    if name == "suffix":
        from dspark.models.drafters.suffix.drafter import DEFAULT_SUFFIX_DIR, SuffixDrafter

        return SuffixDrafter.from_pretrained(kwargs.pop("path", DEFAULT_SUFFIX_DIR), **kwargs)  # type: ignore[arg-type]
    if name == "hybrid":
        from dspark.models.drafters.hybrid import HybridDrafter

        return HybridDrafter.build(target, **kwargs)
    if name not in DEFAULT_CHECKPOINTS:
        raise ValueError(f"unknown drafter {name!r}; expected one of {', '.join(DRAFTER_NAMES)}")
    path = Path(str(kwargs.pop("path", DEFAULT_CHECKPOINTS[name])))
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no {name} checkpoint at {path} (config.json missing)")
    if name in ("dspark", "dflash"):
        from dspark.models.drafters.dspark.drafter import DSparkDrafter

        drafter = DSparkDrafter.from_pretrained(path, target, **kwargs)  # type: ignore[arg-type]
        cfg = drafter.model.config
        if name == "dflash" and (cfg.head_type != "none" or cfg.use_confidence):
            raise ValueError(f"{path} is not a DFlash checkpoint (head_type={cfg.head_type!r}, "
                             f"use_confidence={cfg.use_confidence}); DFlash has neither head")
        drafter.name = name
        return drafter
    from dspark.models.drafters.ar.drafter import ARDrafter
    from dspark.models.drafters.ar.eagle3 import Eagle3Model
    from dspark.models.drafters.ar.mtp import MTPModel

    model_class = Eagle3Model if name == "eagle3" else MTPModel
    return ARDrafter.from_pretrained(model_class, path, target, **kwargs)  # type: ignore[arg-type]


def hidden_layers_of(name: str, target: TargetModel, **kwargs: object) -> tuple[int, ...]:
    """The target layers drafter `name` taps (its `hidden_layers`), read from its checkpoint's config.json
    without loading its weights; a missing checkpoint or one trained for another target is refused as
    `make_drafter` refuses it. For a verify replica, which needs the taps before its drafter is paired."""
    if name in ("none", "ngram", "oracle", "suffix"):
        return ()
    if name == "hybrid":  # its DSpark part, when it has one (HybridDrafter.build drops it if it cannot load)
        if not kwargs.get("use_model", True):
            return ()
        try:
            return _checkpoint_taps("dspark", Path(str(kwargs.get("path") or DEFAULT_CHECKPOINTS["dspark"])), target)
        except (OSError, ValueError):
            return ()
    if name not in DEFAULT_CHECKPOINTS:
        raise ValueError(f"unknown drafter {name!r}; expected one of {', '.join(DRAFTER_NAMES)}")
    path = Path(str(kwargs.get("path", DEFAULT_CHECKPOINTS[name])))
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no {name} checkpoint at {path} (config.json missing)")
    return _checkpoint_taps(name, path, target)


def _checkpoint_taps(name: str, path: Path, target: TargetModel) -> tuple[int, ...]:
    from dspark.models.drafters import target_signature
    from dspark.models.drafters.ar.eagle3_config import Eagle3Config
    from dspark.models.drafters.ar.mtp_config import MTPConfig
    from dspark.models.drafters.dspark.config import DSparkConfig

    config_class = {"dspark": DSparkConfig, "dflash": DSparkConfig, "eagle3": Eagle3Config}.get(name, MTPConfig)
    config = config_class.load(path / "config.json")
    if name == "dflash" and (config.head_type != "none" or config.use_confidence):
        raise ValueError(f"{path} is not a DFlash checkpoint (head_type={config.head_type!r}, "
                         f"use_confidence={config.use_confidence}); DFlash has neither head")
    target_signature.check(config, target.model.config, path)
    return tuple(config.target_layers)
