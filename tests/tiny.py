"""A tiny random Llama causal LM with a small word-level tokenizer, built from a config (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dspark.spec.sps import SPSTable

WORDS = ("the a an of to in is was and or but if then else for while def return print import from "
         "one two three four five six seven eight nine ten cat dog sun moon tree water fire code list "
         "add sum number value true false yes no hello world question answer math chat").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }} <|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def make_tiny_target_dir(out: Path, vocab_extra: int = 0, seed: int = 0) -> Path:
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(specials + list(WORDS))}
    vocab.update({f"w{i}": len(vocab) for i in range(vocab_extra)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.15, tie_word_embeddings=True, eos_token_id=vocab["<|im_end|>"],
                      bos_token_id=vocab["<|im_start|>"], pad_token_id=vocab["<|endoftext|>"])
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init, so outputs have structure
        model.lm_head.weight.mul_(2.0)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    SPSTable(*TEST_SPS).save(out / TEST_SPS_FILE)
    return out


# The SPS curve the engine tests schedule against, kept next to the tiny model: the shape of an earlier
# profile of this CPU (verifying up to ~16 tokens costs little more than one token), so that which lengths
# the tests' schedulers pick does not move when configs/profiles/cpu.json is re-measured.
TEST_SPS = ([1, 8, 16, 32, 64, 128], [70.0, 115.0, 118.0, 195.0, 304.0, 571.0])
TEST_SPS_FILE = "sps_test.json"


def tiny_sps_path(target_dir: Path | str) -> str | None:
    """The test SPS profile `make_tiny_target_dir` wrote into `target_dir`; None for any other target
    (the engine then loads the shipped profile)."""
    path = Path(target_dir) / TEST_SPS_FILE
    return str(path) if path.exists() else None


def pinned_sps_file() -> str:
    """TEST_SPS as a file for any target (written once per process): engine tests on the real SmolLM2 whose
    point is what verification does, not whether this CPU's profile makes verifying pay (on the AVX-512 EPYC
    its bf16 profile rightly verified none of prompt lookup's tokens under Algorithm 1)."""
    import os
    import tempfile

    path = Path(tempfile.gettempdir()) / f"dspark-test-sps-{os.getpid()}.json"
    if not path.exists():
        SPSTable(*TEST_SPS).save(path)
    return str(path)


def greedy_texts(target, prompts: list[list[int]], max_tokens: int) -> list[str]:  # noqa: ANN001
    """What a fault-free single-process target-only engine answers at T=0 (EOS ignored), as text."""
    from dspark.config.engine import EngineConfig
    from dspark.verify_service.engine import Engine
    from dspark.verify_service.request import SamplingParams

    cfg = EngineConfig(target=str(target.path), drafter="none", scheduler="fixed", max_num_seqs=len(prompts),
                       max_model_len=256)
    reqs = Engine(cfg, target=target).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [target.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in reqs]
