"""What every command group shares: the target options, threads and logging, JSON output."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import typer

TARGET = typer.Option("smollm2-135m-instruct", help="HF causal-LM folder or the embedded default.")
DEVICE = typer.Option("cpu", help="cpu or cuda[:N].")
DTYPE = typer.Option(None, help="fp32 | bf16 | fp16 (default: fp32 on CPU, bf16 on GPU).")
THREADS = typer.Option(None, help="torch threads (default: torch's choice).")


def setup(num_threads: int | None, verbose: bool = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if num_threads:
        torch.set_num_threads(num_threads)


def emit(res: dict, out: Path | None, echo: bool = True) -> None:
    line = json.dumps(res)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    if echo:
        typer.echo(line)
