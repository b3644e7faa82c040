"""Training prompts, built offline and never from the eval sets.

Three sources: (1) "Magpie"-style self-synthesis: the target gets its chat template up to the user
turn, with a system message steering the domain, and writes the user message itself; (2) code
prompts derived from Python's standard-library sources (function signatures and docstrings);
(3) questions about the commands documented in this machine's man pages and the topics of Python's
own documentation (`pydoc_data`).
"""

from __future__ import annotations

import ast
import gzip
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

DOMAIN_SYSTEMS = {
    "math": ["You are a student who asks short grade-school math word problems with numbers.",
             "You ask arithmetic and algebra questions and want step-by-step solutions."],
    "code": ["You are a programmer who asks for short Python functions.",
             "You ask coding questions about Python, lists, strings and algorithms."],
    "chat": ["You are a curious person asking a general knowledge question.",
             "You ask for advice, explanations, or short pieces of writing."],
}


@dataclass
class PromptSeed:
    domain: str
    text: str | None  # a finished user message, or None for a Magpie seed
    magpie_ids: list[int] | None  # template up to the user turn, for the target to continue


def magpie_seed_ids(tokenizer: PreTrainedTokenizerBase, system: str) -> list[int]:
    """Chat template with a system message, cut right where the user's message starts."""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                          {"role": "user", "content": marker}], tokenize=False)
    return tokenizer.encode(text[:text.index(marker)], add_special_tokens=False)


def stdlib_code_prompts(limit: int, seed: int = 0) -> list[str]:
    """'Write a Python function ...' prompts from public stdlib functions with docstrings."""
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 20 < len(doc.split("\n\n")[0]) < 400:
                    args = ", ".join(a.arg for a in node.args.args)
                    summary = " ".join(doc.split("\n\n")[0].split())
                    prompts.append(f"Write a Python function `{node.name}({args})`. {summary}")
    random.Random(seed).shuffle(prompts)
    return prompts[:limit]


_MAN_ASKS = ("How do I use the `{cmd}` command ({what})? Show an example.",
             "What does `{cmd}` do on Linux? It is described as: {what}.",
             "Explain the `{cmd}` command ({what}) and its most common options.")
_TOPIC_ASKS = ("Explain {topic} in Python with a short example.",
               "What should a Python programmer know about {topic}?")


def man_page_prompts(limit: int, seed: int = 0, man_dir: Path = Path("/usr/share/man/man1")) -> list[str]:
    """Questions about commands, from the NAME line of each man page on this machine."""
    rng = random.Random(seed)
    paths = sorted(man_dir.glob("*.gz")) if man_dir.is_dir() else []
    rng.shuffle(paths)
    prompts: list[str] = []
    for path in paths:
        if len(prompts) >= limit:
            break
        try:
            head = gzip.open(path, "rt", errors="replace").read(4000)
        except (OSError, EOFError):
            continue
        m = re.search(r"^\.SH\s+\"?NAME\"?\s*\n(.+?)\s+\\-\s+(.+?)$", head, re.M)
        if m is None:
            continue
        cmd, what = m.group(1).split(",")[0].strip().replace("\\", ""), m.group(2).strip().replace("\\", "")
        if 2 <= len(what.split()) <= 20 and re.fullmatch(r"[\w.+-]+", cmd):
            prompts.append(rng.choice(_MAN_ASKS).format(cmd=cmd, what=what))
    return prompts


def pydoc_topic_prompts(limit: int, seed: int = 0) -> list[str]:
    """Questions about the topics of Python's own documentation."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    rng = random.Random(seed)
    names = [t.replace("-", " ") for t in sorted(topics) if len(t) > 2]
    return [rng.choice(_TOPIC_ASKS).format(topic=n) for n in rng.sample(names, min(limit, len(names)))]


def plan_seeds(tokenizer: PreTrainedTokenizerBase, num_prompts: int, mix: dict[str, float],
               num_stdlib: int, seed: int = 0, num_doc: int = 0) -> list[PromptSeed]:
    """num_prompts seeds over domains by `mix`, of which up to num_stdlib come from the stdlib and up
    to num_doc from man pages and Python's documentation (the rest are Magpie seeds)."""
    rng = random.Random(seed)
    seeds = [PromptSeed("code", t, None) for t in stdlib_code_prompts(num_stdlib, seed)]
    num_topics = min(num_doc // 8, 79)
    seeds += [PromptSeed("code", t, None) for t in pydoc_topic_prompts(num_topics, seed)]
    seeds += [PromptSeed("chat", t, None) for t in man_page_prompts(num_doc - num_topics, seed)]
    domains = list(mix)
    weights = [mix[d] for d in domains]
    while len(seeds) < num_prompts:
        d = rng.choices(domains, weights)[0]
        seeds.append(PromptSeed(d, None, magpie_seed_ids(tokenizer, rng.choice(DOMAIN_SYSTEMS[d]))))
    rng.shuffle(seeds)
    return seeds
