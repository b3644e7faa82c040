"""Benchmark prompts from the shared eval sets (evaluation only), chat template applied."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

EVAL_DIR_CANDIDATES = (Path(__file__).resolve().parents[2].parent / "shared" / "data" / "eval",)
DOMAINS = {"gsm8k": "math", "humaneval": "code", "mbpp": "code", "mt-bench": "chat"}


def eval_dir() -> Path:
    for d in EVAL_DIR_CANDIDATES:
        if d.is_dir():
            return d
    raise FileNotFoundError("shared eval sets not found (expected ../shared/data/eval next to the repo)")


def load_turns(dataset: str | Path, limit: int) -> list[str]:
    path = Path(dataset) if str(dataset).endswith(".jsonl") else eval_dir() / f"{dataset}.jsonl"
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line)["turns"][0])
            if len(out) >= limit:
                break
    return out


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, raw: bool = False) -> list[int]:
    """Token ids of a single user turn with the chat template (or the raw text when raw)."""
    if raw or not tokenizer.chat_template:
        return tokenizer.encode(text)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def mixed_prompts(tokenizer: PreTrainedTokenizerBase, num_prompts: int,
                  datasets: tuple[str, ...] = ("gsm8k", "humaneval", "mbpp", "mt-bench"),
                  max_prompt_tokens: int = 512) -> list[tuple[str, list[int]]]:
    """Round-robin over datasets: [(dataset, prompt_ids), ...] of length num_prompts."""
    per = -(-num_prompts // len(datasets)) + 2
    pools = {d: [chat_prompt_ids(tokenizer, t) for t in load_turns(d, per)] for d in datasets}
    pools = {d: [p for p in ps if len(p) <= max_prompt_tokens] for d, ps in pools.items()}
    out: list[tuple[str, list[int]]] = []
    i = 0
    while len(out) < num_prompts:
        d = datasets[i % len(datasets)]
        k = i // len(datasets)
        if k < len(pools[d]):
            out.append((d, pools[d][k]))
        i += 1
        if i > 100 * num_prompts:
            raise ValueError("not enough prompts under max_prompt_tokens")
    return out
