"""Session 60, not kept: the corpus index's two arrays (text and suffix array, 80 MB for 10.35M tokens) copied onto
transparent huge pages (`kernels/huge_pages.py`) before the proposal budget is timed: a cold binary-search probe then
needs no page walk. Runs `s57/propose/propose_budget.py ROUNDS` in this process with `SuffixIndex` patched; with
DSPARK_HUGE_PAGES=0 the copy is skipped (plain pages), so the A/B is the same command with and without it.
    .venv/bin/python docs/results/suffix/s60/propose/hugepage_index.py ROUNDS
    DSPARK_HUGE_PAGES=0 .venv/bin/python docs/results/suffix/s60/propose/hugepage_index.py ROUNDS"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import torch

from dspark.kernels import huge_pages
from dspark.models.drafters.suffix import index as suffix_index


def on_huge_pages(a: np.ndarray) -> np.ndarray:
    if not huge_pages.available() or a.nbytes < huge_pages.HUGE_PAGE:
        return a
    out = huge_pages.empty((a.size,), torch.int32).numpy()
    out[:] = a
    return out


init = suffix_index.SuffixIndex.__init__


def patched(self, text, sa, depth=suffix_index.DEFAULT_DEPTH):  # noqa: ANN001, ANN202 - SuffixIndex's own
    init(self, on_huge_pages(np.ascontiguousarray(text, dtype=np.int32)),
         on_huge_pages(np.ascontiguousarray(sa, dtype=np.int32)), depth)


suffix_index.SuffixIndex.__init__ = patched
budget = Path(__file__).resolve().parents[2] / "s57" / "propose" / "propose_budget.py"
sys.argv = [str(budget), *sys.argv[1:]]
runpy.run_path(str(budget), run_name="__main__")
