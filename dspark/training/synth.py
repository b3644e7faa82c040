"""Self-distillation data: prompts (Magpie, stdlib, man pages, Python docs) and responses regenerated
by the target.

Work is split into shards of `shard_size` prompts, each written atomically as a compressed `.npz` of
plain arrays (token ids as uint16, texts as UTF-8 bytes; nothing pickled) and listed with its sha256
and counts in `manifest.json`, so an interrupted run resumes at the first missing shard and the data
is compact enough to commit (~1 byte per token compressed). Shards are large (hundreds of prompts)
because the engine generates them as one continuously refilled batch of up to `max_num_seqs`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dspark.prompts.eval_sets import chat_prompt_ids
from dspark.prompts.seeds import PromptSeed, plan_seeds
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

log = logging.getLogger(__name__)

DOMAINS = ("math", "code", "chat")
MANIFEST = "manifest.json"


@dataclass
class SynthConfig:
    num_prompts: int = 1024
    num_stdlib_prompts: int = 160
    num_doc_prompts: int = 0
    domain_mix: dict[str, float] = field(default_factory=lambda: {"math": 0.4, "code": 0.25, "chat": 0.35})
    shard_size: int = 512
    prompt_max_tokens: int = 80
    prompt_temperature: float = 1.0
    response_max_tokens: int = 256
    response_temperature: float = 0.7
    response_top_p: float = 0.9
    greedy_fraction: float = 0.0  # share of responses generated at T = 0 (the greedy regime)
    seed: int = 0


def _clean_user_message(text: str) -> str | None:
    text = text.strip()
    if len(text.split()) < 4 or "<|im_" in text or len(text) > 600:
        return None
    return text


def synthesize_shard(engine: Engine, seeds: list[PromptSeed], cfg: SynthConfig, shard_seed: int,
                     progress: tqdm | None = None) -> list[dict]:
    """Records {domain, prompt, prompt_ids, response_ids, temperature, finish_reason} of one shard."""
    tok = engine.tokenizer
    magpie = [s for s in seeds if s.magpie_ids is not None]
    params = [SamplingParams(max_tokens=cfg.prompt_max_tokens, temperature=cfg.prompt_temperature, top_p=0.95,
                             seed=shard_seed * 100_003 + i) for i in range(len(magpie))]
    texts: list[tuple[str, str]] = [(s.domain, s.text) for s in seeds if s.text is not None]
    if magpie:
        for s, req in zip(magpie, engine.generate_bulk([s.magpie_ids for s in magpie], params, progress=progress)):
            msg = _clean_user_message(tok.decode(req.output_ids, skip_special_tokens=True))
            if msg is not None:
                texts.append((s.domain, msg))
    budget = engine.config.max_model_len - cfg.response_max_tokens - engine.config.num_draft_tokens - 1
    encoded = [(d, t, chat_prompt_ids(tok, t)) for d, t in texts]
    kept = [(d, t, ids) for d, t, ids in encoded if len(ids) <= budget]  # the rest could never be served
    texts, prompt_ids = [(d, t) for d, t, _ in kept], [ids for _, _, ids in kept]
    num_greedy = round(cfg.greedy_fraction * len(texts))
    rparams = [SamplingParams(max_tokens=cfg.response_max_tokens,
                              temperature=0.0 if i < num_greedy else cfg.response_temperature,
                              top_p=1.0 if i < num_greedy else cfg.response_top_p,
                              seed=shard_seed * 100_003 + 50_000 + i)
               for i in range(len(texts))]
    records = []
    for (domain, text), ids, p, req in zip(texts, prompt_ids, rparams,
                                           engine.generate_bulk(prompt_ids, rparams, progress=progress)):
        records.append({"domain": domain, "prompt": text, "prompt_ids": ids, "response_ids": req.output_ids,
                        "temperature": p.temperature, "finish_reason": str(req.finish_reason)})
    return records


def _ragged(seqs: list[list[int]] | list[bytes], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.frombuffer(b"".join(seqs), dtype=np.uint8) if dtype is bytes else np.array(
        [t for s in seqs for t in s], dtype=dtype)
    return flat, offsets


def write_shard(path: Path, records: list[dict], vocab_size: int) -> dict:
    """Write records as one compressed npz of plain arrays (atomic); returns its manifest entry."""
    id_dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    arrays: dict[str, np.ndarray] = {}
    for key in ("prompt_ids", "response_ids"):
        arrays[key], arrays[key + "_offsets"] = _ragged([r[key] for r in records], id_dtype)
    arrays["prompt_text"], arrays["prompt_text_offsets"] = _ragged(
        [r["prompt"].encode("utf-8") for r in records], bytes)
    arrays["domain"] = np.array([DOMAINS.index(r["domain"]) for r in records], dtype=np.uint8)
    arrays["temperature"] = np.array([r["temperature"] for r in records], dtype=np.float32)
    arrays["is_stop"] = np.array([r["finish_reason"] == "stop" for r in records], dtype=np.bool_)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, path)
    return {"name": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "num_records": len(records), "num_response_tokens": int(len(arrays["response_ids"])),
            "num_prompt_tokens": int(len(arrays["prompt_ids"])),
            "domains": {d: int((arrays["domain"] == i).sum()) for i, d in enumerate(DOMAINS)},
            "num_greedy": int((arrays["temperature"] == 0).sum())}


def read_shard(path: Path) -> list[dict]:
    with np.load(path, allow_pickle=False) as z:
        def split(key: str) -> list[np.ndarray]:
            off = z[key + "_offsets"]
            flat = z[key]
            return [flat[off[i]:off[i + 1]] for i in range(len(off) - 1)]
        texts = [b.tobytes().decode("utf-8") for b in split("prompt_text")]
        prompts, responses = split("prompt_ids"), split("response_ids")
        return [{"domain": DOMAINS[int(d)], "prompt": t, "prompt_ids": p.astype(np.int64).tolist(),
                 "response_ids": r.astype(np.int64).tolist(), "temperature": round(float(temp), 6),
                 "finish_reason": "stop" if stop else "length"}
                for d, t, p, r, temp, stop in zip(z["domain"], texts, prompts, responses, z["temperature"],
                                                  z["is_stop"])]


def _load_manifest(out_dir: Path) -> dict:
    path = out_dir / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {"shards": []}


def _save_manifest(out_dir: Path, manifest: dict) -> None:
    shards = manifest["shards"]
    manifest["totals"] = {k: sum(s[k] for s in shards) for k in
                          ("num_records", "num_response_tokens", "num_prompt_tokens", "num_greedy")}
    manifest["totals"]["domains"] = {d: sum(s["domains"][d] for s in shards) for d in DOMAINS}
    manifest["totals"]["wall_s"] = round(sum(s.get("wall_s", 0.0) for s in shards), 1)
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out_dir / MANIFEST)


def run_synthesis(engine: Engine, cfg: SynthConfig, out_dir: Path, max_wall_s: float | None = None) -> dict:
    """Write shards shard-XXXXX.npz into out_dir; shards already listed in the manifest are kept (resume).

    `max_wall_s`: stop after the shard that crosses this budget (the run resumes from there later).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _load_manifest(out_dir)
    manifest["config"] = asdict(cfg)
    done = {s["name"] for s in manifest["shards"] if (out_dir / s["name"]).exists()}
    seeds = plan_seeds(engine.tokenizer, cfg.num_prompts, cfg.domain_mix, cfg.num_stdlib_prompts, cfg.seed,
                       cfg.num_doc_prompts)
    num_shards = -(-len(seeds) // cfg.shard_size)
    t0 = time.perf_counter()
    new_tokens = 0
    progress = tqdm(desc="synthesize", unit="tok", smoothing=0.05)
    for i in range(num_shards):
        path = out_dir / f"shard-{i:05d}.npz"
        if path.name in done:
            continue
        t_shard = time.perf_counter()
        records = synthesize_shard(engine, seeds[i * cfg.shard_size:(i + 1) * cfg.shard_size], cfg,
                                   cfg.seed + i, progress)
        entry = write_shard(path, records, engine.runner.vocab_size)
        entry["wall_s"] = round(time.perf_counter() - t_shard, 1)
        manifest["shards"] = [s for s in manifest["shards"] if s["name"] != path.name] + [entry]
        manifest["shards"].sort(key=lambda s: s["name"])
        _save_manifest(out_dir, manifest)
        new_tokens += entry["num_response_tokens"]
        progress.set_postfix(shard=f"{i + 1}/{num_shards}", resp_tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
        if max_wall_s is not None and time.perf_counter() - t0 > max_wall_s:
            break
    progress.close()
    complete = all((out_dir / f"shard-{i:05d}.npz").exists() for i in range(num_shards))
    return {"num_shards": num_shards, "is_complete": complete, "wall_s": time.perf_counter() - t0,
            "new_response_tokens": new_tokens, "totals": _load_manifest(out_dir).get("totals", {})}


def load_records(data_dir: Path) -> list[dict]:
    """All shards (npz, or the older JSONL), deduplicated by normalised prompt text (first kept)."""
    seen: set[str] = set()
    records = []
    paths = sorted(data_dir.glob("shard-*.npz")) + sorted(data_dir.glob("responses-*.jsonl"))
    for path in paths:
        rows = read_shard(path) if path.suffix == ".npz" else [json.loads(line) for line in open(path)]
        for r in rows:
            key = " ".join(r["prompt"].lower().split())
            if key in seen or not r["response_ids"]:
                continue
            seen.add(key)
            records.append(r)
    return records
