"""Shared fixtures: a tiny random Llama target saved as a real HF folder (with a real tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.models.target.loader import TargetModel, load_target
from tests.tiny import make_tiny_target_dir


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir: Path) -> TargetModel:
    torch.set_num_threads(2)
    return load_target(str(tiny_target_dir))
