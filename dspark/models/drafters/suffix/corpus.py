"""The target's own text for the suffix proposer: the responses of the committed self-distilled shards.

Reads the shards' arrays directly (no per-token Python), and can hold out the records whose prompt falls
in the calibration split (the same stable prompt hash as training's held-out split), so a calibration run
never finds its own answers in the index.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_CORPUS_DIRS = ("data/distill/smollm2", "data/distill/smollm2-more")


def prompt_bucket(text: str) -> int:
    """A stable bucket 0..9999 of a prompt (the training pipeline's held-out split uses the same hash)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 10_000


def corpus_paths(dirs: list[str] | tuple[str, ...] = DEFAULT_CORPUS_DIRS) -> list[Path]:
    """Shard files of the given folders (relative paths: to the repo root), sorted; missing folders skipped."""
    paths: list[Path] = []
    for d in dirs:
        folder = Path(d).expanduser()
        folder = folder if folder.is_absolute() else REPO_ROOT / folder
        paths += sorted(folder.glob("shard-*.npz"))
    return paths


def read_responses(paths: list[Path], heldout_fraction: float = 0.0, keep_heldout: bool = False,
                   max_tokens: int | None = None) -> list[np.ndarray]:
    """Each record's response token ids (int32). With heldout_fraction > 0, records whose prompt bucket is
    below the cut are left out (keep_heldout=False) or are the only ones kept (True). `max_tokens` stops
    after that many tokens (for the τ-vs-corpus-size curve), in shard order."""
    cut = int(heldout_fraction * 10_000)
    docs: list[np.ndarray] = []
    total = 0
    for path in paths:
        with np.load(path, allow_pickle=False) as z:
            flat, off = z["response_ids"].astype(np.int32), z["response_ids_offsets"]
            if cut:
                texts, toff = z["prompt_text"], z["prompt_text_offsets"]
                held = [prompt_bucket(texts[toff[i]:toff[i + 1]].tobytes().decode("utf-8")) < cut
                        for i in range(len(off) - 1)]
            for i in range(len(off) - 1):
                if cut and held[i] != keep_heldout:
                    continue
                doc = flat[off[i]:off[i + 1]]
                if max_tokens is not None and total + len(doc) > max_tokens:
                    return docs
                docs.append(doc)
                total += len(doc)
    return docs


def read_heldout_prompts(paths: list[Path], heldout_fraction: float, limit: int) -> list[dict]:
    """Up to `limit` held-out records {prompt_ids (chat-templated), domain (0 math, 1 code, 2 chat),
    temperature}, for calibration runs."""
    cut = int(heldout_fraction * 10_000)
    out: list[dict] = []
    for path in paths:
        with np.load(path, allow_pickle=False) as z:
            texts, toff = z["prompt_text"], z["prompt_text_offsets"]
            ids, ioff = z["prompt_ids"], z["prompt_ids_offsets"]
            for i in range(len(toff) - 1):
                if prompt_bucket(texts[toff[i]:toff[i + 1]].tobytes().decode("utf-8")) >= cut:
                    continue
                out.append({"prompt_ids": ids[ioff[i]:ioff[i + 1]].astype(np.int64).tolist(),
                            "domain": int(z["domain"][i]), "temperature": float(z["temperature"][i])})
                if len(out) >= limit:
                    return out
    return out
