"""Baseline drafters (DFlash, EAGLE-3, MTP-1): shapes, what each position may see, inference = training,
checkpoints, the registry, and the CE-only / KL objectives on hand-computed cases."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from dspark.cli import app
from dspark.models.drafters.ar.drafter import ARDrafter
from dspark.models.drafters.ar.eagle3 import Eagle3Model
from dspark.models.drafters.ar.eagle3_config import Eagle3Config
from dspark.models.drafters.ar.model import ARDraftModel
from dspark.models.drafters.ar.mtp import MTPModel
from dspark.models.drafters.ar.mtp_config import MTPConfig
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.dspark.config import DSparkConfig
from dspark.models.drafters.dspark.drafter import DSparkDrafter
from dspark.models.drafters.dspark.model import DSparkModel, DSparkTrainOutput
from dspark.models.drafters.registry import hidden_layers_of, make_drafter
from dspark.spec.chi2 import ALPHA, chi_square_pvalue
from dspark.training.losses import dspark_loss, loss_weights
from tests.tiny_drafters import GAMMA, NUM_DRAFT_VOCAB, draft_vocab, make_ar, make_dflash, save_tiny_baseline


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny ops: a second thread buys nothing, and on a loaded 2-core machine it spins.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def random_batch(model: ARDraftModel, batch: int, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, length, model.config.num_context_features, generator=gen)
    token_ids = torch.randint(0, model.config.target_vocab_size, (batch, length), generator=gen)
    return features, token_ids


def forced_block(model: ARDraftModel, features: torch.Tensor, token_ids: torch.Tensor, anchor: int,
                 tokens: list[int]) -> DSparkTrainOutput:
    """forward_train of one block at `anchor` with `tokens` written after it (teacher forcing on drafts)."""
    forced = token_ids.clone()
    forced[0, anchor + 1:anchor + 1 + len(tokens)] = torch.tensor(tokens)
    return model.forward_train(features, forced, torch.tensor([[anchor]]))


# ---- configs ---------------------------------------------------------------------------------------------
def test_configs_round_trip_and_refuse_the_other_kind(tiny_target, tmp_path):
    eagle = make_ar(tiny_target, "eagle3").config
    eagle.save(tmp_path / "e.json")
    assert Eagle3Config.load(tmp_path / "e.json") == eagle and eagle.model_type == "eagle3"
    assert eagle.num_context_features == 3 * tiny_target.model.config.hidden_size
    with pytest.raises(ValueError, match="model_type"):
        MTPConfig.load(tmp_path / "e.json")
    mtp = make_ar(tiny_target, "mtp1").config
    assert mtp.block_size == 1 and mtp.model_type == "mtp1"
    with pytest.raises(ValueError, match="block_size"):
        MTPConfig.from_dict({**mtp.to_dict(), "block_size": 2})
    with pytest.raises(ValueError, match="one target layer"):
        MTPConfig.from_dict({**mtp.to_dict(), "target_layers": [1, 3]})
    with pytest.raises(ValueError, match="unknown"):
        Eagle3Config.from_dict({**eagle.to_dict(), "gama": 3})


# ---- EAGLE-3 -----------------------------------------------------------------------------------------------
def test_eagle3_train_shapes_and_validity(tiny_target):
    model = make_ar(tiny_target, "eagle3")
    features, token_ids = random_batch(model, 2, 16)
    out = model.forward_train(features, token_ids, torch.tensor([[1, 6, 12], [0, 5, 7]]),
                              seq_lens=torch.tensor([16, 9]))
    assert out.logits.shape == (2, 3, GAMMA, NUM_DRAFT_VOCAB) and out.confidence_logits is None
    assert out.is_valid.shape == out.labels.shape == (2, 3, GAMMA)
    assert out.is_valid[0, 2].tolist() == [True, True, True, False, False]
    assert out.is_valid[1, 2].tolist() == [True, False, False, False, False]
    assert not out.is_valid[1, 0].any()  # anchor 0 has no feature before it: nothing to train
    assert out.labels[0, 1].tolist() == token_ids[0, 7:12].tolist()
    assert torch.isfinite(out.logits).all()


def test_eagle3_block_sees_features_before_its_anchor_and_tokens_up_to_the_predicted_one_only(tiny_target):
    model = make_ar(tiny_target, "eagle3")
    features, token_ids = random_batch(model, 1, 20)
    anchors = torch.tensor([[6, 13]])
    base = model.forward_train(features, token_ids, anchors).logits  # (1, 2, γ, N)

    after = features.clone()
    after[0, 6:] += 1.0  # the unrolled steps feed back their own hidden states, never the target's
    logits = model.forward_train(after, token_ids, anchors).logits
    torch.testing.assert_close(logits[:, 0], base[:, 0], rtol=0, atol=1e-5)
    assert not torch.allclose(logits[:, 1], base[:, 1])

    before = features.clone()
    before[0, 5] += 1.0  # step 1 reads the feature of position anchor-1
    assert not torch.allclose(model.forward_train(before, token_ids, anchors).logits[0, 0, 0], base[0, 0, 0])

    for k in range(1, GAMMA):  # x_{a+k} is the label of step k and the input of step k+1
        other = token_ids.clone()
        other[0, 6 + k] = (other[0, 6 + k] + 1) % model.config.target_vocab_size
        logits = model.forward_train(features, other, anchors).logits
        torch.testing.assert_close(logits[0, 0, :k], base[0, 0, :k], rtol=0, atol=1e-5)
        assert not torch.allclose(logits[0, 0, k], base[0, 0, k])


def test_eagle3_unrolled_steps_feed_back_their_own_hidden_state(tiny_target):
    """Step 2 by hand: the layer's output of step 1 is step 2's feature, the ground-truth x_{a+1} its token."""
    model = make_ar(tiny_target, "eagle3")
    features, token_ids = random_batch(model, 1, 12)
    a = 7
    out = model.forward_train(features, token_ids, torch.tensor([[a]])).logits[0, 0]
    feats = model.encode_features(features[0, :a])  # real positions 0..a-1 pair with tokens 1..a
    x = model._input(feats, token_ids[0, 1:a + 1])[None]
    cos, sin = model._rope(torch.arange(a))
    real, k_real, v_real = model.layer(x, cos, sin, None, None, torch.ones(a, a, dtype=torch.bool).tril())
    step1 = real[0, a - 1]
    x2 = model._input(step1, token_ids[0, a + 1])[None, None]
    cos2, sin2 = model._rope(torch.tensor([a]))
    step2, _, _ = model.layer(x2, cos2, sin2, k_real, v_real, torch.ones(1, 1, 1, a + 1, dtype=torch.bool))
    torch.testing.assert_close(out[0], model._logits(step1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], model._logits(step2[0, 0]), rtol=1e-4, atol=1e-4)


# ---- MTP-1 -------------------------------------------------------------------------------------------------
def test_mtp_position_reads_the_hidden_state_at_t_and_the_token_at_t_plus_1_and_nothing_later(tiny_target):
    model = make_ar(tiny_target, "mtp1")
    features, token_ids = random_batch(model, 1, 16)
    a = 8  # the block at anchor a is MTP position t = a-1: h_t and x_{t+1} = x_a predict x_{t+2}
    anchors = torch.tensor([[a]])
    out = model.forward_train(features, token_ids, anchors)
    assert out.logits.shape == (1, 1, 1, NUM_DRAFT_VOCAB)
    assert out.labels[0, 0].tolist() == [token_ids[0, a + 1].item()]
    base = out.logits

    later_h = features.clone()
    later_h[0, a:] += 1.0
    torch.testing.assert_close(model.forward_train(later_h, token_ids, anchors).logits, base, rtol=0, atol=1e-6)
    later_x = token_ids.clone()
    later_x[0, a + 1:] = (later_x[0, a + 1:] + 1) % model.config.target_vocab_size
    torch.testing.assert_close(model.forward_train(features, later_x, anchors).logits, base, rtol=0, atol=1e-6)
    h_t = features.clone()
    h_t[0, a - 1] += 1.0
    assert not torch.allclose(model.forward_train(h_t, token_ids, anchors).logits, base)
    x_next = token_ids.clone()
    x_next[0, a] = (x_next[0, a] + 1) % model.config.target_vocab_size
    assert not torch.allclose(model.forward_train(features, x_next, anchors).logits, base)


# ---- inference = training ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_rounds_of_observe_and_propose_match_teacher_forced_training(tiny_target, kind):
    """Prefill, then verification rounds that accept some drafts: each round's greedy drafts (and their
    logits) are what forward_train gives on the same prefix, so the K/V cache carries exactly the past."""
    model = make_ar(tiny_target, kind)
    drafter = ARDrafter(model, tiny_target)
    features, token_ids = random_batch(model, 1, 30)
    gamma = model.config.block_size
    drafter.observe("r", features[0, :3])
    drafter.observe("r", features[0, 3:6])  # prefill delivered in two chunks
    anchor = 6
    for num_accepted in (2, 0, 3, 1):
        drafted = drafter.propose([DraftRequest("r", token_ids[0, :anchor + 1].tolist(), 0.0)], 7)
        tokens = drafted.tokens[0]
        assert len(tokens) == gamma and drafted.probs is None
        assert set(tokens) <= set(model.draft_to_target.tolist())
        out = forced_block(model, features, token_ids, anchor, tokens)
        assert model.draft_to_target[out.logits[0, 0].argmax(-1)].tolist() == tokens
        # proposing again in the same round is allowed; sampled at T=1 the distributions are softmax(logits)
        sampled = drafter.propose([DraftRequest("r", token_ids[0, :anchor + 1].tolist(), 1.0)], 7)
        out = forced_block(model, features, token_ids, anchor, sampled.tokens[0])
        torch.testing.assert_close(sampled.probs[0][:, model.draft_to_target], torch.softmax(out.logits[0, 0], -1),
                                   rtol=1e-4, atol=1e-6)
        # the sequence takes the target's tokens; the engine observes 1 + accepted new cache positions
        n = min(num_accepted, gamma) + 1
        drafter.observe("r", features[0, anchor:anchor + n])
        last_anchor, anchor = anchor, anchor + n
    state = drafter._states["r"]  # real positions are cached once; the anchor's predecessor stays pending
    assert state.num_cached == last_anchor - 1 and state.num_observed == anchor
    drafter.release("r")
    assert not drafter._states


@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_batched_propose_with_padding_equals_one_request_at_a_time(tiny_target, kind):
    model = make_ar(tiny_target, kind)
    drafter = ARDrafter(model, tiny_target)
    features, token_ids = random_batch(model, 3, 16)
    lengths = {"a": 4, "b": 13, "c": 1}
    for r, (rid, n) in enumerate(lengths.items()):
        drafter.observe(rid, features[r, :n])
    reqs = [DraftRequest(rid, token_ids[r, :n + 1].tolist(), 0.0) for r, (rid, n) in enumerate(lengths.items())]
    together = drafter.propose(reqs, 4)
    alone = [drafter.propose([req], 4) for req in reqs]
    assert together.tokens == [a.tokens[0] for a in alone]
    assert all(len(t) == min(4, model.config.block_size) for t in together.tokens)
    # a second round after different numbers of accepted tokens, again batched vs alone
    for r, (rid, n) in enumerate(lengths.items()):
        drafter.observe(rid, features[r, n:n + 1 + r])
    reqs = [DraftRequest(rid, token_ids[r, :n + 2 + r].tolist(), 0.0) for r, (rid, n) in enumerate(lengths.items())]
    together = drafter.propose(reqs, 4)
    assert together.tokens == [drafter.propose([req], 4).tokens[0] for req in reqs]
    with pytest.raises(ValueError, match="observed features"):
        drafter.propose([DraftRequest("a", token_ids[0, :3].tolist(), 0.0)], 4)


@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_sampled_propose_returns_the_distributions_the_tokens_were_drawn_from(tiny_target, kind):
    model = make_ar(tiny_target, kind)
    drafter = ARDrafter(model, tiny_target, seed=5)
    features, token_ids = random_batch(model, 2, 12)
    drafter.observe("hot", features[0, :7])
    drafter.observe("cold", features[1, :9])
    reqs = [DraftRequest("hot", token_ids[0, :8].tolist(), 0.8), DraftRequest("cold", token_ids[1, :10].tolist(), 0.0)]
    out = drafter.propose(reqs, 7)
    k = model.config.block_size
    outside = torch.ones(model.config.target_vocab_size, dtype=torch.bool)
    outside[model.draft_to_target] = False
    for tokens, probs in zip(out.tokens, out.probs):
        assert probs.shape == (k, model.config.target_vocab_size)
        torch.testing.assert_close(probs.sum(-1), torch.ones(k))
        assert (probs[:, outside] == 0).all()
        assert (probs[torch.arange(k), torch.tensor(tokens)] > 0).all()
    assert ((out.probs[1] == 0) | (out.probs[1] == 1)).all()  # the greedy request's drafts are point masses
    # the hot request's first distribution is softmax(step-1 logits / T) of the teacher-forced model
    logits = forced_block(model, features[:1], token_ids[:1], 7, out.tokens[0][:1]).logits[0, 0, 0]
    torch.testing.assert_close(out.probs[0][0, model.draft_to_target], torch.softmax(logits / 0.8, -1),
                               rtol=1e-4, atol=1e-5)


def test_eagle3_sampled_tokens_follow_the_returned_distributions_step_after_step(tiny_target):
    """The same request in 4000 rows: step 1 has one distribution for all rows; step 2, given the most
    frequent first token, has one distribution for those rows. Chi-square at ALPHA (false failure odds
    1e-4 per check; the seed is fixed, so the verdict is deterministic)."""
    model = make_ar(tiny_target, "eagle3")
    features, token_ids = random_batch(model, 1, 10)
    num_rows, num_pending = 4000, 6
    with torch.no_grad():
        model.draft_lm_head.mul_(0.2)  # flatter distributions: many cells get counts
    block = model.draft(None, torch.zeros(num_rows, dtype=torch.long),
                        features[:, :num_pending].expand(num_rows, -1, -1),
                        token_ids[:, 1:num_pending + 1].expand(num_rows, -1),
                        torch.full((num_rows,), num_pending), temperatures=torch.full((num_rows,), 1.3),
                        num_tokens=2, generator=torch.Generator().manual_seed(0))
    first = block.probs[0, 0]
    torch.testing.assert_close(block.probs[:, 0], first.expand(num_rows, -1))
    torch.testing.assert_close(first, torch.softmax(block.logits[0, 0] / 1.3, -1))
    assert chi_square_pvalue(torch.bincount(block.draft_ids[:, 0], minlength=NUM_DRAFT_VOCAB), first) > ALPHA
    rows = block.draft_ids[:, 0] == block.draft_ids[:, 0].mode().values
    second = block.probs[rows, 1]
    torch.testing.assert_close(second, second[:1].expand_as(second))
    counts = torch.bincount(block.draft_ids[rows, 1], minlength=NUM_DRAFT_VOCAB)
    assert chi_square_pvalue(counts, second[0]) > ALPHA


# ---- checkpoints, registry, initialisation ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp1"])
def test_a_drafters_taps_are_read_from_its_config_as_loading_it_would_give_them(tiny_target, tmp_path, kind):
    model = make_dflash(tiny_target) if kind == "dflash" else make_ar(tiny_target, kind)
    model.save_pretrained(tmp_path / "ckpt")
    path = str(tmp_path / "ckpt")
    assert hidden_layers_of(kind, tiny_target, path=path) == make_drafter(kind, tiny_target, path=path).hidden_layers
    assert hidden_layers_of("ngram", tiny_target) == ()
    with pytest.raises(FileNotFoundError):
        hidden_layers_of(kind, tiny_target, path=str(tmp_path / "missing"))
    if kind != "dflash":  # the other AR kind's config is refused, as loading it is
        with pytest.raises(ValueError, match="model_type"):
            hidden_layers_of("mtp1" if kind == "eagle3" else "eagle3", tiny_target, path=path)


@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_checkpoint_round_trip_through_the_registry(tiny_target, tmp_path, kind):
    model = make_ar(tiny_target, kind)
    model.save_pretrained(tmp_path / "ckpt")
    drafter = make_drafter(kind, tiny_target, path=str(tmp_path / "ckpt"))
    assert isinstance(drafter, ARDrafter) and drafter.name == kind
    loaded = drafter.model
    assert type(loaded) is type(model) and loaded.config == model.config
    assert torch.equal(loaded.draft_to_target, model.draft_to_target)
    assert torch.equal(loaded.target_to_draft, model.target_to_draft)
    assert drafter.hidden_layers == tuple(model.config.target_layers)
    features, token_ids = random_batch(model, 1, 10)
    anchors = torch.tensor([[2, 6]])
    assert torch.equal(model.forward_train(features, token_ids, anchors).logits,
                       loaded.forward_train(features, token_ids, anchors).logits)
    other = "mtp1" if kind == "eagle3" else "eagle3"
    with pytest.raises(ValueError, match="model_type"):
        make_drafter(other, tiny_target, path=str(tmp_path / "ckpt"))


def test_dflash_is_the_dspark_backbone_without_heads_and_loads_by_name(tiny_target, tmp_path):
    model = make_dflash(tiny_target)
    assert not hasattr(model, "transition") and not hasattr(model, "confidence_head")
    model.save_pretrained(tmp_path / "dflash")
    drafter = make_drafter("dflash", tiny_target, path=str(tmp_path / "dflash"))
    assert isinstance(drafter, DSparkDrafter) and drafter.name == "dflash"
    features, token_ids = random_batch(model, 1, 12)  # type: ignore[arg-type]
    drafter.observe("r", features[0, :6])
    out = drafter.propose([DraftRequest("r", token_ids[0, :7].tolist(), 0.0)], 7)
    assert out.confidences is None and len(out.tokens[0]) == GAMMA
    forced = forced_block(model, features, token_ids, 6, out.tokens[0])  # type: ignore[arg-type]
    assert model.draft_to_target[forced.logits[0, 0].argmax(-1)].tolist() == out.tokens[0]

    cfg = DSparkConfig.from_target(tiny_target.model.config, NUM_DRAFT_VOCAB, intermediate_size=96)
    DSparkModel(cfg, draft_vocab(tiny_target.model.config.vocab_size)).save_pretrained(tmp_path / "dspark")
    with pytest.raises(ValueError, match="not a DFlash checkpoint"):
        make_drafter("dflash", tiny_target, path=str(tmp_path / "dspark"))
    with pytest.raises(FileNotFoundError):
        make_drafter("eagle3", tiny_target, path=str(tmp_path / "missing"))


@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_init_from_target_copies_the_top_layer_and_passes_the_feature_through(tiny_target, kind):
    hf_cfg = tiny_target.model.config
    if kind == "eagle3":
        model: ARDraftModel = Eagle3Model(Eagle3Config.from_target(hf_cfg, NUM_DRAFT_VOCAB, [1, 2, 3]))
    else:
        model = MTPModel(MTPConfig.from_target(hf_cfg, NUM_DRAFT_VOCAB, [hf_cfg.num_hidden_layers]))
    layers = tiny_target.model.model.layers
    assert model.init_from_target(tiny_target.model) == [len(layers) - 1]
    top, d = layers[-1], hf_cfg.hidden_size
    assert torch.equal(model.layer.qkv_proj.weight[:top.self_attn.q_proj.weight.shape[0]], top.self_attn.q_proj.weight)
    assert torch.equal(model.layer.down_proj.weight, top.mlp.down_proj.weight)
    assert torch.equal(model.layer.post_norm.weight, top.post_attention_layernorm.weight)
    assert torch.equal(model.norm.weight, tiny_target.model.model.norm.weight)
    assert torch.allclose(model.in_proj.weight[:, d:], torch.eye(d), atol=0.05)  # feature half ≈ identity
    assert model.in_proj.weight[:, :d].abs().max() < 0.05
    if kind == "eagle3":
        assert torch.allclose(model.fc.weight[:, -d:], torch.eye(d), atol=0.05)


# ---- objectives --------------------------------------------------------------------------------------------
def hand_case() -> tuple[DSparkTrainOutput, torch.Tensor]:
    """One block, γ = 2, N = 3, both positions valid, both labels in the draft vocab."""
    logits = torch.tensor([[[[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]]]])  # (1, 1, 2, 3)
    labels = torch.tensor([[[0, 2]]])
    is_valid = torch.ones(1, 1, 2, dtype=torch.bool)
    out = DSparkTrainOutput(logits=logits, confidence_logits=None, is_valid=is_valid, labels=labels,
                            draft_labels=labels, is_label_in_draft_vocab=is_valid.clone())
    target_probs = torch.tensor([[[[0.5, 0.25, 0.25], [0.2, 0.3, 0.3]]]])  # second row: 0.2 outside the vocab
    return out, target_probs


def test_ce_only_loss_is_the_position_weighted_nll_of_the_label(tiny_target):
    out, target_probs = hand_case()
    nll1 = -(1.0 - math.log(math.e + 1 + math.exp(-1)))  # -log softmax([1, 0, -1])[0]
    nll2 = -(0.0 - math.log(2 + math.exp(2)))  # -log softmax([0, 2, 0])[2]
    w1, w2 = 1.0, math.exp(-1 / 2)  # exp(-(k-1)/γ), γ = 2
    loss = dspark_loss(out, target_probs, loss_weights("ce"))
    assert loss.total.item() == pytest.approx((w1 * nll1 + w2 * nll2) / (w1 + w2), rel=1e-6)
    assert loss.ce.item() == pytest.approx(loss.total.item())
    # a position whose label is outside the draft vocab drops out of CE
    out.is_label_in_draft_vocab[0, 0, 1] = False
    assert dspark_loss(out, target_probs, loss_weights("ce")).total.item() == pytest.approx(nll1, rel=1e-6)
    with pytest.raises(ValueError, match="unknown loss"):
        loss_weights("mse")


def test_kl_loss_is_the_position_weighted_kl_over_the_draft_vocab(tiny_target):
    out, target_probs = hand_case()
    log_pd = torch.log_softmax(out.logits[0, 0].double(), -1)
    p_t = target_probs[0, 0].double()
    kl = (p_t * (p_t.log() - log_pd)).sum(-1)  # both rows: Σ over the draft vocab
    w = torch.tensor([1.0, math.exp(-1 / 2)], dtype=torch.float64)
    loss = dspark_loss(out, target_probs, loss_weights("kl"))
    assert loss.total.item() == pytest.approx(((w * kl).sum() / w.sum()).item(), rel=1e-5)
    # its gradient is the soft cross-entropy's: p_d − p_t (rows renormalised to the draft vocab's target mass)
    logits = out.logits.clone().requires_grad_(True)
    out.logits = logits
    dspark_loss(out, target_probs, loss_weights("kl")).total.backward()
    expected = (log_pd.exp() * p_t.sum(-1, keepdim=True) - p_t) * (w / w.sum())[:, None]
    torch.testing.assert_close(logits.grad[0, 0].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_kl_training_reduces_the_loss_on_a_tiny_batch(tiny_target, kind):
    model = make_ar(tiny_target, kind).train()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(0.1)
    features, token_ids = random_batch(model, 2, 12)
    anchors = torch.tensor([[1, 4, 8], [2, 5, 9]])
    gamma = model.config.block_size
    gen = torch.Generator().manual_seed(9)
    target_probs = torch.softmax(3 * torch.randn(2, 3, gamma, model.config.target_vocab_size, generator=gen), -1)
    target_probs = target_probs[..., model.draft_to_target]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    history = []
    for _ in range(40):
        loss = dspark_loss(model.forward_train(features, token_ids, anchors), target_probs, loss_weights("kl"))
        opt.zero_grad()
        loss.total.backward()
        opt.step()
        history.append(loss)
    assert history[-1].kl < 0.7 * history[0].kl and history[-1].tv < history[0].tv
    assert model.target_embed.grad is None and not model.draft_lm_head.requires_grad


# ---- CLI ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp1"])
def test_eval_and_bench_decode_accept_the_baseline_names(tiny_target_dir, tiny_target, tmp_path, kind):
    ckpt = save_tiny_baseline(tiny_target, kind, tmp_path / kind)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"turns": [t]}) for t in ("one two three", "the cat and the dog")) + "\n")
    runner = CliRunner()
    res = runner.invoke(app, ["eval", "--drafter", kind, "--checkpoint", str(ckpt), "--target", str(tiny_target_dir),
                              "--datasets", str(data), "--temperature", "0", "--num-prompts", "2",
                              "--max-new-tokens", "8", "--label", f"{kind}_run", "--out-dir", str(tmp_path / "eval")])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["drafter"] == f"{kind}_run" and summary["kind"] == kind and summary["T=0.0"]["tau_macro"] >= 1.0
    assert summary["gamma"] == (1 if kind == "mtp1" else GAMMA)  # no --block-size: the checkpoint's own
    res = runner.invoke(app, ["compare", str(tmp_path / "eval" / f"eval_{kind}_run.json"), "--temperature", "0.0",
                              "--out", str(tmp_path / "compare.png")])
    assert res.exit_code == 0, res.output
    table = json.loads(res.stdout.strip().splitlines()[-1])
    assert table["tau"][f"{kind}_run"]["0.0"]["tau_macro"] == summary["T=0.0"]["tau_macro"]
    assert (tmp_path / "compare.png").stat().st_size > 0
    res = runner.invoke(app, ["bench", "decode", "--drafters", kind, "--checkpoint", f"{kind}={ckpt}",
                              "--target", str(tiny_target_dir), "--batch-sizes", "1", "--num-prompts", "1",
                              "--max-new-tokens", "8", "--hf-dtypes", ""])
    assert res.exit_code == 0, res.output
    arm = json.loads(res.stdout.strip().splitlines()[-1])["batch1"]["drafters"][kind]
    assert arm["greedy_identical_to_target_only"] and arm["tau"] >= 1.0
    res = runner.invoke(app, ["bench", "decode", "--drafters", kind, "--checkpoint", f"{kind}={tmp_path / 'none'}",
                              "--target", str(tiny_target_dir), "--batch-sizes", "1", "--hf-dtypes", ""])
    assert res.exit_code == 2 and "no " + kind + " checkpoint" in res.output
