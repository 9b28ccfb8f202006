"""The small digits ViT (explain_modbp.digits_vit): AttnLRP and CP-LRP run on it unchanged,
CP-LRP conserves on its bias-free copy, its attention maps are the ones it uses, and it trains
above chance within seconds, deterministically."""

from __future__ import annotations

import copy

import pytest
import torch

from explain_core import explain
from explain_core.data.digits import load_digits
from explain_modbp.digits_vit import DigitsViT, bias_free_copy, train_digits_vit

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Five quick epochs: batch 16 starts learning soonest (the benchmark's 40 epochs reach ~98%).
QUICK = {"epochs": 5, "batch_size": 16}


@pytest.fixture(scope="module")
def trained() -> tuple[DigitsViT, float]:
    return train_digits_vit(seed=0, **QUICK)


@pytest.fixture(scope="module")
def digits() -> torch.Tensor:
    return load_digits().test_images[:6].double()


def test_it_trains_above_chance_in_a_few_epochs(trained):
    _, accuracy = trained
    assert accuracy > 0.5  # chance: 0.1


def test_training_is_deterministic_for_a_seed(trained):
    again, accuracy = train_digits_vit(seed=0, **QUICK)
    assert accuracy == trained[1]
    first, second = trained[0].state_dict(), again.state_dict()
    assert all(torch.equal(first[k], second[k].to(first[k].dtype)) for k in first)


@pytest.mark.parametrize("method", ["lrp.attn", "lrp.cp"])
def test_attention_methods_run_on_it(trained, digits, method):
    model = copy.deepcopy(trained[0]).double()
    result = explain(model, digits, method, target=None)
    assert result.attribution.shape == digits.shape
    assert bool(torch.isfinite(result.attribution).all())
    torch.testing.assert_close(result.output, model(digits).detach())
    gradient = explain(model, digits, "input_x_gradient", target=None).attribution
    assert not torch.allclose(result.attribution, gradient, atol=1e-6)  # the rules act


@pytest.mark.parametrize("state", ["untrained", "trained"])
def test_cp_lrp_conserves_on_the_bias_free_copy(trained, digits, state):
    torch.manual_seed(1)
    model = DigitsViT() if state == "untrained" else copy.deepcopy(trained[0])
    model = model.double().eval()
    free = bias_free_copy(model)
    assert not bool(free.position.any()) and not bool(free.cls_token.any())
    for target in (0, 7):
        result = explain(free, digits, "lrp.cp", target)
        logit = free(digits)[:, target].detach()
        total = result.attribution.sum((1, 2, 3))
        torch.testing.assert_close(total, logit, rtol=1e-10, atol=1e-12)
    attn = explain(free, digits, "lrp.attn", 7)
    assert bool((attn.delta.abs() > 1e-6).any())  # AttnLRP's softmax rule does not conserve
    # and with the constants kept, CP-LRP misses by what they absorb
    kept = explain(model, digits, "lrp.cp", 7)
    assert bool((kept.delta.abs() > 1e-6).any())


def test_attention_maps_are_the_ones_the_model_uses(trained, digits):
    model = copy.deepcopy(trained[0]).double()
    maps, logits = model.attention_maps(digits)
    torch.testing.assert_close(logits, model(digits).detach())
    blocks, heads = len(model.encoder.layers), model.encoder.layers[0].self_attn.num_heads
    tokens = model.num_patches + 1
    assert maps.shape == (blocks, len(digits), heads, tokens, tokens)
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1], dtype=maps.dtype))
    # and nn.MultiheadAttention's own weights agree for the first block
    layer = model.encoder.layers[0]
    normed = layer.norm1(model.tokens(digits))
    _, own = layer.self_attn(normed, normed, normed, average_attn_weights=False)
    torch.testing.assert_close(maps[0], own.detach())


def test_the_patch_size_must_divide_the_image():
    with pytest.raises(ValueError, match="must divide"):
        DigitsViT(patch_size=3)
