"""Self-distillation shards: compact, pickle-free, resumable, and read back exactly."""

from __future__ import annotations

import json

import numpy as np

from dspark.config.engine import EngineConfig
from dspark.prompts.seeds import man_page_prompts, pydoc_topic_prompts
from dspark.training.synth import SynthConfig, load_records, read_shard, run_synthesis, write_shard
from dspark.verify_service.engine import Engine


def _records() -> list[dict]:
    return [{"domain": "math", "prompt": "What is 2 + 2? Think step by step.", "prompt_ids": [1, 2, 3],
             "response_ids": [40000, 5, 65535], "temperature": 0.7, "finish_reason": "stop"},
            {"domain": "chat", "prompt": "Écris un poème — court, s'il te plaît.", "prompt_ids": [7],
             "response_ids": [9] * 300, "temperature": 0.0, "finish_reason": "length"}]


def test_a_shard_round_trips_exactly_as_plain_uint16_arrays(tmp_path):
    path = tmp_path / "shard-00000.npz"
    entry = write_shard(path, _records(), vocab_size=65536)
    assert read_shard(path) == _records()
    with np.load(path, allow_pickle=False) as z:  # loads with pickle refused: plain arrays only
        assert z["response_ids"].dtype == np.uint16 and z["prompt_text"].dtype == np.uint8
    assert entry["num_records"] == 2 and entry["num_response_tokens"] == 303 and entry["num_greedy"] == 1
    assert entry["domains"] == {"math": 1, "code": 0, "chat": 1} and len(entry["sha256"]) == 64


def test_synthesis_writes_a_manifest_resumes_and_dedups(tiny_target, tmp_path):
    engine = Engine(EngineConfig(target=str(tiny_target.path), drafter="none", scheduler="fixed", num_draft_tokens=0,
                                 max_num_seqs=8, max_model_len=256), target=tiny_target)
    cfg = SynthConfig(num_prompts=6, num_stdlib_prompts=2, num_doc_prompts=2, shard_size=3, prompt_max_tokens=12,
                      response_max_tokens=16, greedy_fraction=0.34)
    first = run_synthesis(engine, cfg, tmp_path, max_wall_s=1e-9)  # budget spent after one shard: stops there
    assert not first["is_complete"] and len(list(tmp_path.glob("shard-*.npz"))) == 1
    rest = run_synthesis(engine, cfg, tmp_path)  # resumes at the missing shard
    assert rest["is_complete"] and len(list(tmp_path.glob("shard-*.npz"))) == 2
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["name"] for s in manifest["shards"]] == ["shard-00000.npz", "shard-00001.npz"]
    assert manifest["totals"]["num_records"] == sum(s["num_records"] for s in manifest["shards"])
    assert manifest["totals"]["num_greedy"] >= 1  # the T = 0 share is there
    records = load_records(tmp_path)
    assert len({" ".join(r["prompt"].lower().split()) for r in records}) == len(records)


def test_offline_corpora_give_prompts_without_any_hub():
    topics = pydoc_topic_prompts(5)
    assert len(topics) == 5 and all("Python" in t for t in topics)
    man = man_page_prompts(5)  # this machine's man pages; none on a machine without them
    assert all("`" in m for m in man)
