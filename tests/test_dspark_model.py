"""DSpark draft model: packed training forward, context masking, heads, inference path, checkpoints, loss."""

from __future__ import annotations

import pytest
import torch

from dspark.config.engine import EngineConfig
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.dspark.config import DSparkConfig, default_target_layers
from dspark.models.drafters.dspark.drafter import DSparkDrafter
from dspark.models.drafters.dspark.model import DSparkModel
from dspark.models.target.loader import TargetModel
from dspark.spec.chi2 import ALPHA, chi_square_pvalue
from dspark.spec.sps import SPSTable
from dspark.training.losses import dspark_loss, position_weights
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams

NUM_DRAFT_VOCAB = 40
GAMMA = 5


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny ops: a second thread buys nothing, and on a loaded 2-core machine it spins (measured 50x slower).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def draft_vocab(vocab: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:NUM_DRAFT_VOCAB]


def make_model(target: TargetModel, head_type: str = "markov", seed: int = 0, is_zero_init: bool = False,
               **overrides: object) -> DSparkModel:
    torch.manual_seed(seed)
    hf_cfg = target.model.config
    cfg = DSparkConfig.from_target(hf_cfg, NUM_DRAFT_VOCAB, markov_rank=16, intermediate_size=96,
                                   block_size=GAMMA, head_type=head_type, **overrides)
    model = DSparkModel(cfg, draft_vocab(hf_cfg.vocab_size))
    if not is_zero_init and head_type != "none":
        with torch.no_grad():  # a non-trivial sequential head, so tests see it act
            torch.nn.init.normal_(model.transition, std=0.5)
    if cfg.use_confidence:
        with torch.no_grad():
            torch.nn.init.normal_(model.confidence_head.weight, std=0.5)
    model.attach_target(target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight)
    return model.eval()


def random_batch(model: DSparkModel, batch: int, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, length, model.config.num_context_features, generator=gen)
    token_ids = torch.randint(0, model.config.target_vocab_size, (batch, length), generator=gen)
    return features, token_ids


# ---- config --------------------------------------------------------------------------------------------
def test_config_round_trips_through_json_and_rejects_bad_values(tiny_target, tmp_path):
    cfg = make_model(tiny_target).config
    cfg.save(tmp_path / "c.json")
    assert DSparkConfig.load(tmp_path / "c.json") == cfg
    assert cfg.hidden_size == tiny_target.model.config.hidden_size
    assert default_target_layers(30) == [2, 15, 28]
    with pytest.raises(ValueError, match="sts_temperatures"):
        DSparkConfig.from_dict({**cfg.to_dict(), "sts_temperatures": [1.0]})
    with pytest.raises(ValueError, match="head_type"):
        DSparkConfig.from_dict({**cfg.to_dict(), "head_type": "lstm"})
    with pytest.raises(ValueError, match="unknown"):
        DSparkConfig.from_dict({**cfg.to_dict(), "gama": 3})


# ---- training forward ------------------------------------------------------------------------------------
def test_forward_train_shapes_and_validity(tiny_target):
    model = make_model(tiny_target)
    features, token_ids = random_batch(model, 2, 16)
    anchors = torch.tensor([[0, 6, 12], [1, 5, 7]])
    out = model.forward_train(features, token_ids, anchors, seq_lens=torch.tensor([16, 9]))
    assert out.logits.shape == (2, 3, GAMMA, NUM_DRAFT_VOCAB)
    assert out.confidence_logits.shape == out.is_valid.shape == out.labels.shape == (2, 3, GAMMA)
    # anchor 12 of a 16-token sequence has targets 13, 14, 15 only; anchor 7 of a 9-token one has 8 only
    assert out.is_valid[0, 2].tolist() == [True, True, True, False, False]
    assert out.is_valid[1, 2].tolist() == [True, False, False, False, False]
    assert out.labels[0, 1].tolist() == token_ids[0, 7:12].tolist()


def test_block_sees_context_before_its_anchor_and_its_own_block_only(tiny_target):
    model = make_model(tiny_target)
    features, token_ids = random_batch(model, 1, 20)
    anchors = torch.tensor([[4, 12]])
    base = model.forward_train(features, token_ids, anchors).logits

    after = features.clone()
    after[0, 4:] += 1.0  # the anchor has no features of its own: nothing from position 4 on is visible
    logits = model.forward_train(after, token_ids, anchors).logits
    torch.testing.assert_close(logits[:, 0], base[:, 0], rtol=0, atol=1e-6)
    assert not torch.allclose(logits[:, 1], base[:, 1])

    before = features.clone()
    before[0, 3] += 1.0
    assert not torch.allclose(model.forward_train(before, token_ids, anchors).logits[:, 0], base[:, 0])

    other = token_ids.clone()  # block 1's anchor token is outside block 0 (which reads tokens 4..9)
    other[0, 12] = (other[0, 12] + 1) % model.config.target_vocab_size
    logits = model.forward_train(features, other, anchors).logits
    torch.testing.assert_close(logits[:, 0], base[:, 0], rtol=0, atol=1e-6)
    assert not torch.allclose(logits[:, 1], base[:, 1])


def test_zero_initialised_transition_makes_markov_equal_the_parallel_model(tiny_target):
    markov = make_model(tiny_target, "markov", is_zero_init=True, use_confidence=False)
    parallel = make_model(tiny_target, "none", use_confidence=False)
    parallel.load_state_dict({k: v for k, v in markov.state_dict().items() if k in parallel.state_dict()})
    features, token_ids = random_batch(markov, 2, 12)
    anchors = torch.tensor([[2, 7], [0, 5]])
    torch.testing.assert_close(markov.forward_train(features, token_ids, anchors).logits,
                               parallel.forward_train(features, token_ids, anchors).logits)


def test_rnn_head_shapes_and_prefix_dependence(tiny_target):
    model = make_model(tiny_target, "rnn")
    features, token_ids = random_batch(model, 2, 14)
    token_ids[0, 4] = model.draft_to_target[0]
    anchors = torch.tensor([[3, 8], [0, 6]])
    out = model.forward_train(features, token_ids, anchors)
    assert out.logits.shape == (2, 2, GAMMA, NUM_DRAFT_VOCAB)
    assert out.confidence_logits.shape == (2, 2, GAMMA)
    changed = token_ids.clone()  # x*_1 of block (0, 0): feeds the state of positions 2..γ, not position 1
    changed[0, 4] = model.draft_to_target[1]
    logits = model.forward_train(features, changed, anchors).logits
    torch.testing.assert_close(logits[0, 0, 0], out.logits[0, 0, 0])
    assert not torch.allclose(logits[0, 0, 2:], out.logits[0, 0, 2:])  # memory beyond one step


def test_save_load_round_trip_gives_identical_outputs(tiny_target, tmp_path):
    model = make_model(tiny_target)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = DSparkModel.from_pretrained(tmp_path / "ckpt")
    loaded.attach_target(tiny_target.model.get_input_embeddings().weight,
                         tiny_target.model.get_output_embeddings().weight)
    assert torch.equal(loaded.draft_to_target, model.draft_to_target)
    assert torch.equal(loaded.target_to_draft, model.target_to_draft)
    features, token_ids = random_batch(model, 1, 10)
    anchors = torch.tensor([[1, 4]])
    a, b = model.forward_train(features, token_ids, anchors), loaded.eval().forward_train(features, token_ids, anchors)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.confidence_logits, b.confidence_logits)

    drafter = DSparkDrafter.from_pretrained(tmp_path / "ckpt", tiny_target)
    drafter.observe("r", features[0, :4])
    tokens = drafter.propose([DraftRequest("r", token_ids[0, :5].tolist(), 0.0)], 3).tokens[0]
    forced = token_ids.clone()
    forced[0, 5:8] = torch.tensor(tokens)
    assert model.draft_to_target[model.forward_train(features, forced, torch.tensor([[4]])).logits[0, 0, :3].argmax(-1)
                                 ].tolist() == tokens


# ---- inference -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_type", ["markov", "rnn", "none"])
@pytest.mark.parametrize("is_anchor_in_draft_vocab", [True, False])
def test_observe_and_propose_match_teacher_forced_training(tiny_target, head_type, is_anchor_in_draft_vocab):
    model = make_model(tiny_target, head_type)
    drafter = DSparkDrafter(model, tiny_target)
    features, token_ids = random_batch(model, 1, 16)
    anchor = 9
    outside = sorted(set(range(model.config.target_vocab_size)) - set(model.draft_to_target.tolist()))
    token_ids[0, anchor] = model.draft_to_target[3] if is_anchor_in_draft_vocab else outside[0]
    for lo, hi in ((0, 5), (5, 8), (8, 9)):  # chunks as prefill and verification steps deliver them
        drafter.observe("r", features[0, lo:hi])
    drafted = drafter.propose([DraftRequest("r", token_ids[0, :anchor + 1].tolist(), 0.0)], 7)
    tokens = drafted.tokens[0]
    assert len(tokens) == GAMMA and drafted.probs is None
    assert set(tokens) <= set(model.draft_to_target.tolist())

    forced = token_ids.clone()
    forced[0, anchor + 1:anchor + 1 + GAMMA] = torch.tensor(tokens)
    out = model.forward_train(features, forced, torch.tensor([[anchor]]))
    assert model.draft_to_target[out.logits[0, 0].argmax(-1)].tolist() == tokens
    expected_conf = torch.sigmoid(out.confidence_logits[0, 0])
    torch.testing.assert_close(torch.tensor(drafted.confidences[0]), expected_conf, rtol=1e-4, atol=1e-5)

    kv = model.context_kv(features[0, :anchor], 0)[:, :, None]
    block = model.draft(kv, token_ids[0, anchor:anchor + 1], torch.tensor([anchor]))
    torch.testing.assert_close(block.logits[0], out.logits[0, 0], rtol=1e-4, atol=1e-4)


def test_observe_queues_rows_until_a_draft_needs_them(tiny_target):
    # the engine may skip drafting for many steps (draft gate): rows wait and are projected in one call
    model = make_model(tiny_target)
    lazy, eager = DSparkDrafter(model, tiny_target), DSparkDrafter(model, tiny_target)
    features, token_ids = random_batch(model, 1, 24)
    for i in range(10):
        lazy.observe("r", features[0, i:i + 1])
    assert "r" not in lazy._contexts  # nothing projected yet
    eager.observe("r", features[0, :10])
    first = lazy.propose([DraftRequest("r", token_ids[0, :11].tolist(), 0.0)], 4)
    assert lazy._contexts["r"].length == 10
    assert first.tokens == eager.propose([DraftRequest("r", token_ids[0, :11].tolist(), 0.0)], 4).tokens
    for i in range(10, 20):  # a second round, queued again
        lazy.observe("r", features[0, i:i + 1])
    eager.observe("r", features[0, 10:20])
    second = lazy.propose([DraftRequest("r", token_ids[0, :21].tolist(), 0.0)], 4)
    expected = eager.propose([DraftRequest("r", token_ids[0, :21].tolist(), 0.0)], 4)
    assert second.tokens == expected.tokens
    torch.testing.assert_close(torch.tensor(second.confidences), torch.tensor(expected.confidences),
                               rtol=1e-4, atol=1e-5)
    long_rows = features[0, :1].expand(300, -1)
    for row in long_rows:  # a request that never drafts: the queue is bounded
        lazy.observe("idle", row[None])
    assert lazy._contexts["idle"].length == 256 and lazy._num_pending["idle"] == 44
    lazy.release("idle")
    assert "idle" not in lazy._contexts and "idle" not in lazy._pending


def test_batched_propose_with_padding_equals_one_request_at_a_time(tiny_target):
    model = make_model(tiny_target)
    drafter = DSparkDrafter(model, tiny_target)
    features, token_ids = random_batch(model, 2, 14)
    lengths = {"a": 6, "b": 13}
    for r, (rid, n) in enumerate(lengths.items()):
        drafter.observe(rid, features[r, :n])
    reqs = [DraftRequest(rid, token_ids[r, :n + 1].tolist(), 0.0) for r, (rid, n) in enumerate(lengths.items())]
    together = drafter.propose(reqs, 4)
    alone = [drafter.propose([req], 4) for req in reqs]
    assert together.tokens == [a.tokens[0] for a in alone]
    assert all(len(t) == 4 for t in together.tokens)
    for c, a in zip(together.confidences, alone):
        torch.testing.assert_close(torch.tensor(c), torch.tensor(a.confidences[0]), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="observed features"):
        drafter.propose([DraftRequest("a", token_ids[0, :5].tolist(), 0.0)], 4)


def test_confidences_are_probabilities_and_sts_shrinks_them_monotonically(tiny_target):
    model = make_model(tiny_target)
    features, token_ids = random_batch(model, 1, 12)
    kv = model.context_kv(features[0, :8], 0)[:, :, None]
    distances = []
    for temp in (0.5, 1.0, 2.0, 4.0):
        model.config.sts_temperatures = [temp] * GAMMA
        conf = model.draft(kv, token_ids[0, 8:9], torch.tensor([8])).confidences[0]
        assert ((conf > 0) & (conf < 1)).all()
        distances.append((conf - 0.5).abs())
    assert all((hi >= lo).all() for hi, lo in zip(distances, distances[1:]))
    assert (distances[0] > distances[-1]).all()


def test_sampled_propose_returns_distributions_over_the_draft_vocab(tiny_target):
    model = make_model(tiny_target)
    drafter = DSparkDrafter(model, tiny_target, seed=5)
    features, token_ids = random_batch(model, 2, 12)
    drafter.observe("hot", features[0, :7])
    drafter.observe("cold", features[1, :9])
    out = drafter.propose([DraftRequest("hot", token_ids[0, :8].tolist(), 0.8),
                           DraftRequest("cold", token_ids[1, :10].tolist(), 0.0)], 7)
    outside = torch.ones(model.config.target_vocab_size, dtype=torch.bool)
    outside[model.draft_to_target] = False
    for tokens, probs in zip(out.tokens, out.probs):
        assert probs.shape == (GAMMA, model.config.target_vocab_size)
        torch.testing.assert_close(probs.sum(-1), torch.ones(GAMMA))
        assert (probs[:, outside] == 0).all()
        assert (probs[torch.arange(GAMMA), torch.tensor(tokens)] > 0).all()  # each token drawn from its row
    assert ((out.probs[1] == 0) | (out.probs[1] == 1)).all()  # the greedy request's drafts are point masses


def test_sampled_draft_tokens_follow_the_returned_distribution(tiny_target):
    model = make_model(tiny_target)
    features, token_ids = random_batch(model, 1, 12)
    num_rows = 4000  # the same request many times: position 1 has one distribution for all rows
    kv = model.context_kv(features[0, :8], 0)[:, :, None].expand(-1, -1, num_rows, -1, -1, -1)
    block = model.draft(kv, token_ids[0, 8:9].expand(num_rows), torch.full((num_rows,), 8),
                        temperatures=torch.full((num_rows,), 1.3), generator=torch.Generator().manual_seed(0))
    probs = block.probs[0, 0]
    torch.testing.assert_close(block.probs[:, 0], probs.expand(num_rows, -1))
    torch.testing.assert_close(probs, torch.softmax(block.logits[0, 0] / 1.3, -1))
    counts = torch.bincount(block.draft_ids[:, 0], minlength=NUM_DRAFT_VOCAB)
    assert chi_square_pvalue(counts, probs) > ALPHA  # false failure odds 1e-4 (fixed seed: deterministic)


# ---- loss --------------------------------------------------------------------------------------------------
def test_loss_decreases_when_overfitting_a_tiny_batch(tiny_target):
    model = make_model(tiny_target, is_zero_init=True).train()
    features, token_ids = random_batch(model, 2, 12)
    anchors = torch.tensor([[0, 4, 8], [1, 5, 9]])
    gen = torch.Generator().manual_seed(9)
    target_probs = torch.softmax(3 * torch.randn(2, 3, GAMMA, model.config.target_vocab_size, generator=gen), -1)
    target_probs = target_probs[..., model.draft_to_target]  # (B, M, γ, N): some mass lies outside
    assert torch.equal(position_weights(3), torch.exp(-torch.arange(3) / 3))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    history = []
    for _ in range(100):
        loss = dspark_loss(model.forward_train(features, token_ids, anchors), target_probs)
        opt.zero_grad()
        loss.total.backward()
        opt.step()
        history.append(loss)
    first, last = history[0], history[-1]
    assert last.total < 0.7 * first.total
    assert last.tv < first.tv and last.ce < first.ce and last.conf < first.conf
    assert last.acceptance_per_position.shape == (GAMMA,)
    assert (last.acceptance_per_position > first.acceptance_per_position).all()
    assert model.target_embed.grad is None and not model.draft_lm_head.requires_grad


# ---- end to end ------------------------------------------------------------------------------------------
def test_engine_with_random_dspark_drafter_matches_target_only_greedy(tiny_target, tmp_path):
    sps_path = tmp_path / "sps.json"
    SPSTable.from_sps({1: 100.0, 8: 80.0, 64: 20.0}).save(sps_path)
    gen = torch.Generator().manual_seed(11)
    vocab = tiny_target.model.config.vocab_size
    prompts = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in (3, 11, 25, 7, 18)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    common = dict(target=str(tiny_target.path), max_model_len=256, max_num_seqs=4)
    plain = Engine(EngineConfig(**common, drafter="none", num_draft_tokens=0, scheduler="fixed"), target=tiny_target)
    expected = [r.output_ids for r in plain.generate(prompts, params)]

    drafter = DSparkDrafter(make_model(tiny_target), tiny_target)
    engine = Engine(EngineConfig(**common, drafter="ngram", scheduler="greedy", num_draft_tokens=GAMMA,
                                 sps_profile=str(sps_path)), target=tiny_target, drafter=drafter)
    reqs = engine.generate(prompts, params)
    assert [r.output_ids for r in reqs] == expected
    assert sum(r.num_verified for r in reqs) > 0  # drafts really went through verification
    assert not drafter._contexts  # every finished request was released

    # sampled requests: draft distributions go through the probabilistic acceptance rule
    sampled = engine.generate(prompts[:3], SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=1))
    assert all(len(r.output_ids) == 24 for r in sampled)
    assert sum(r.num_verified for r in sampled) > 0


def test_init_from_target_copies_the_top_layers_and_passes_the_top_feature_through(tiny_target):
    hf_cfg = tiny_target.model.config
    cfg = DSparkConfig.from_target(hf_cfg, NUM_DRAFT_VOCAB, block_size=GAMMA, num_layers=2)
    model = DSparkModel(cfg, draft_vocab(hf_cfg.vocab_size))
    copied = model.init_from_target(tiny_target.model)
    layers = tiny_target.model.model.layers
    assert copied == [len(layers) - 2, len(layers) - 1]
    top = layers[-1]
    d = cfg.hidden_size
    assert torch.equal(model.layers[1].qkv_proj.weight[:top.self_attn.q_proj.weight.shape[0]],
                       top.self_attn.q_proj.weight)
    assert torch.equal(model.layers[1].down_proj.weight, top.mlp.down_proj.weight)
    assert torch.equal(model.layers[0].post_norm.weight, layers[-2].post_attention_layernorm.weight)
    assert torch.equal(model.context_norm.weight, layers[-2].input_layernorm.weight)
    # fc ≈ identity on the highest tapped feature, small on the others
    assert torch.allclose(model.fc.weight[:, -d:], torch.eye(d), atol=0.05)
    assert model.fc.weight[:, :-d].abs().max() < 0.05
    model.attach_target(tiny_target.model.get_input_embeddings().weight,
                        tiny_target.model.get_output_embeddings().weight)
    features, token_ids = random_batch(model, 2, 24)
    out = model.forward_train(features, token_ids, torch.tensor([[3, 10], [5, 12]]))
    assert torch.isfinite(out.logits).all()


def test_init_from_target_rejects_a_target_of_another_shape(tiny_target):
    cfg = DSparkConfig.from_target(tiny_target.model.config, NUM_DRAFT_VOCAB, intermediate_size=96)
    model = DSparkModel(cfg, draft_vocab(tiny_target.model.config.vocab_size))
    with pytest.raises(ValueError, match="shape"):
        model.init_from_target(tiny_target.model)
