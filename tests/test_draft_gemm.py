"""The drafter's GEMMs on measured kernels (draft_gemm.py): every kernel drafts what F.linear drafts, and a
weight changed or replaced after planning is never drafted from a stale copy."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.gemm_plan import GemmPlan, available_kernels
from dspark.models.drafters.draft_gemm import DraftGemm
from dspark.models.drafters.dspark.model import DSparkModel
from tests.test_dspark_model import make_model, one_thread, random_batch  # noqa: F401 - one_thread: autouse
from tests.tiny_drafters import make_ar


def _draft(model: DSparkModel, features: torch.Tensor, token_ids: torch.Tensor, anchor: int):  # noqa: ANN202
    with torch.inference_mode():
        kv = model.context_kv(features[0, :anchor], 0)[:, :, None]
        temps = torch.tensor([0.0])
        return model.draft(kv, token_ids[0, anchor:anchor + 1], torch.tensor([anchor]), None, temps)


def _unplanned(model: DSparkModel):  # noqa: ANN202
    gemm = model.gemm
    model.gemm = None
    for layer in model.layers:
        layer.gemm = None
    return gemm


def _replan(model: DSparkModel, gemm: DraftGemm) -> None:
    model.gemm = gemm
    for layer in model.layers:
        layer.gemm = gemm


@pytest.mark.parametrize("head_type", ["markov", "rnn"])
def test_every_kernel_drafts_what_f_linear_drafts(tiny_target, tmp_path, head_type):
    model = make_model(tiny_target, head_type)
    features, token_ids = random_batch(model, 1, 16)
    reference = _draft(model, features, token_ids, 9)
    gemm = model.plan_gemm(tmp_path)
    assert set(gemm.linears) >= {"head", "fc", "layers.0.qkv", "layers.0.kv", "layers.0.gate_up", "layers.0.down"}
    assert set(gemm.plan.layer_kernels) == set(gemm.plan.head_kernels)  # a kernel for every row bucket
    kernels = available_kernels(False, gemm.linears["head"].weight)
    assert {"linear", "wx"} <= set(kernels)
    for kernel in kernels:
        gemm.plan = GemmPlan.fixed(kernel)
        block = _draft(model, features, token_ids, 9)
        assert torch.equal(block.draft_ids, reference.draft_ids), kernel
        torch.testing.assert_close(block.logits, reference.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block.confidences, reference.confidences, rtol=1e-5, atol=1e-5)


def test_a_weight_changed_or_replaced_after_planning_is_read_again(tiny_target, tmp_path):
    model = make_model(tiny_target)
    features, token_ids = random_batch(model, 1, 16)
    gemm = model.plan_gemm(tmp_path)
    gemm.plan = GemmPlan.fixed("native" if "native" in available_kernels(False, model.fc.weight) else "wx")
    _draft(model, features, token_ids, 9)  # packs every weight in the chosen kernel's layout
    with torch.no_grad():  # in place, as an optimizer step does
        model.fc.weight.mul_(-1.5)
        model.layers[0].gate_up_proj.weight.add_(0.3)
        model.transition.mul_(2.0)
    model.set_draft_vocab(torch.flip(model.draft_to_target, [0]))  # replaces the draft LM head buffer
    planned = _draft(model, features, token_ids, 9)
    _unplanned(model)
    reference = _draft(model, features, token_ids, 9)
    _replan(model, gemm)
    assert torch.equal(planned.draft_ids, reference.draft_ids)
    torch.testing.assert_close(planned.logits, reference.logits, rtol=1e-5, atol=1e-5)


def test_training_forwards_keep_autograd(tiny_target, tmp_path):
    model = make_model(tiny_target)
    model.plan_gemm(tmp_path)
    features, token_ids = random_batch(model, 2, 16)
    out = model.forward_train(features, token_ids, torch.tensor([[3], [6]]))
    out.logits.float().sum().backward()
    assert model.fc.weight.grad is not None and model.layers[0].qkv_proj.weight.grad is not None


@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_autoregressive_baselines_draft_the_same_on_every_kernel(tiny_target, tmp_path, kind):
    model = make_ar(tiny_target, kind)
    gen = torch.Generator().manual_seed(2)
    num_pending = 6
    features = torch.randn(1, num_pending, model.config.num_context_features, generator=gen)
    ids = torch.randint(0, model.config.target_vocab_size, (1, num_pending), generator=gen)

    def draft():  # noqa: ANN202
        with torch.inference_mode():
            return model.draft(None, torch.zeros(1, dtype=torch.long), features, ids, torch.tensor([num_pending]))

    reference = draft()
    gemm = model.plan_gemm(tmp_path)
    assert {"head", "in_proj", "layer.qkv", "layer.down"} <= set(gemm.linears)
    assert ("fc" in gemm.linears) == (kind == "eagle3")
    for kernel in available_kernels(False, gemm.linears["head"].weight):
        gemm.plan = GemmPlan.fixed(kernel)
        block = draft()
        assert torch.equal(block.draft_ids, reference.draft_ids), kernel
        torch.testing.assert_close(block.new_kv, reference.new_kv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block.logits[:, 0], reference.logits[:, 0], rtol=1e-5, atol=1e-4)
        # fp32 sums in another order, fed back through γ steps of a random layer: up to ~5e-4 on logits ~7
        torch.testing.assert_close(block.logits, reference.logits, rtol=1e-4, atol=2e-3)
