"""The tiny family targets of dspark/bench/tiny_targets.py with the word-level tokenizer and the test SPS profile
of tests/tiny.py."""

from __future__ import annotations

import shutil
from pathlib import Path

from dspark.bench.tiny_targets import FAMILY_CONFIGS, GENERIC, NATIVE, WINDOW
from dspark.bench.tiny_targets import make_family_dir as make_bare_family_dir
from tests.tiny import TEST_SPS_FILE

__all__ = ["FAMILY_CONFIGS", "GENERIC", "NATIVE", "WINDOW", "make_family_dir"]


def make_family_dir(kind: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random `kind` model with the tokenizer of `tokenizer_dir` (the tiny Llama's), saved to `out` with the
    tiny Llama's test SPS profile."""
    make_bare_family_dir(kind, out, tokenizer_dir, seed)
    shutil.copy(Path(tokenizer_dir) / TEST_SPS_FILE, out / TEST_SPS_FILE)
    return out
