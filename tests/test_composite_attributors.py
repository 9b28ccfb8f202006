"""Composites under the attributors that take gradients (``composite=``), as in Zennit.

References: the LRP methods of the same composites (Input×Gradient over a composite is its
relevance), z⁺'s positive homogeneity on bias-free ReLU nets (Integrated Gradients over z⁺ from a
zero baseline equals z⁺ for any number of steps), SmoothGrad written out over the same seeded
noise, and the exact contributions of dynamic-linear models.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from explain_coda import CoDANet, LayerSpec
from explain_core import Composite, InvalidInputError, Rule, explain
from explain_modbp import composites

PAIRS = [
    ("z", "lrp.z"),
    ("epsilon", "lrp.epsilon"),
    ("zplus", "lrp.zplus"),
    ("alpha2beta1", "lrp.alpha2beta1"),
    ("gamma", "lrp.gamma"),
    ("epsilon_plus", "lrp.epsilon_plus"),
    ("cmp", "lrp.cmp"),
]


def cnn(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=bias),
        nn.BatchNorm2d(4, affine=bias),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1, bias=bias),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 5, bias=bias),
    )
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 2.0)
        if bias:
            model[1].running_mean.normal_(0, 0.3)
    return model.double().eval()


X = torch.randn(3, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("composite", "method"), PAIRS)
def test_input_x_gradient_over_a_composite_is_its_relevance(composite, method):
    model = cnn()
    over = explain(model, X, "input_x_gradient", 2, composite=composite)
    lrp = explain(model, X, method, 2)
    torch.testing.assert_close(over.attribution, lrp.attribution, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(over.delta, lrp.delta, rtol=1e-10, atol=1e-12)


def test_a_composite_object_works_like_its_name():
    model = cnn()
    custom = composites.lrp_epsilon_plus().with_rules((nn.Linear, composites.rules.Epsilon(0.3)))
    by_object = explain(model, X, "input_x_gradient", 1, composite=custom).attribution
    by_method = explain(model, X, "lrp.custom", 1, composite=custom).attribution
    torch.testing.assert_close(by_object, by_method, rtol=1e-12, atol=1e-14)


def test_excitation_over_input_x_gradient_is_excitation_bp_scaled_by_the_output():
    # Excitation BP starts from 1 at the explained output, the attributor from the output.
    model = cnn()
    over = explain(model, X, "input_x_gradient", 2, composite="excitation")
    probability = explain(model, X, "excitation_bp", 2).attribution
    scale = over.output[:, 2].reshape(-1, 1, 1, 1)
    torch.testing.assert_close(over.attribution, probability * scale, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_integrated_gradients_over_zplus_is_zplus_on_bias_free_relu_nets(steps):
    # z⁺'s signal does not change when the input is scaled by α > 0 on a bias-free ReLU net, so
    # the path integral from 0 is z⁺ itself, whatever the quadrature.
    model = cnn(bias=False)
    x = X.abs()  # z⁺ of the first layer on non-negative inputs
    integrated = explain(model, x, "integrated_gradients", 2, composite="zplus", steps=steps)
    zplus = explain(model, x, "lrp.zplus", 2).attribution
    torch.testing.assert_close(integrated.attribution, zplus, rtol=1e-10, atol=1e-12)


def test_smoothgrad_over_a_composite_is_the_mean_modified_gradient_over_the_same_noise():
    model = cnn()
    samples, level, seed = 5, 0.2, 7
    smooth = explain(
        model, X, "smoothgrad", 2, composite="epsilon_plus", samples=samples,
        noise_level=level, seed=seed, internal_batch_size=6,
    ).attribution  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    flat = X.flatten(1)
    sigma = (level * (flat.amax(1) - flat.amin(1))).reshape(-1, 1, 1, 1)
    total = torch.zeros_like(X)
    for _ in range(samples):
        noise = torch.randn((1, *X.shape[1:]), generator=generator, dtype=X.dtype)
        noisy = X + sigma * noise  # one draw for every sample
        total += explain(model, noisy, "gradient", 2, composite="epsilon_plus").attribution
    torch.testing.assert_close(smooth, total / samples, rtol=1e-10, atol=1e-12)
    without_noise = explain(model, X, "smoothgrad", 2, composite="zplus", noise_level=0.0)
    signal = explain(model, X, "gradient", 2, composite="zplus").attribution
    torch.testing.assert_close(without_noise.attribution, signal, rtol=1e-12, atol=1e-14)


def test_the_explanation_mode_composite_gives_exact_contributions():
    torch.manual_seed(0)
    specs = [LayerSpec(6, 4, 3, 1), LayerSpec(4, 5, 1, 1)]
    model = CoDANet(specs, (2, 7, 9)).double().eval()
    x = torch.rand(3, 2, 7, 9, dtype=torch.float64)
    over = explain(model, x, "input_x_gradient", 1, composite="explanation_mode").attribution
    exact = explain(model, x, "dynamic.contributions", 1).attribution
    torch.testing.assert_close(over, exact, rtol=1e-12, atol=1e-14)
    plain = explain(model, x, "input_x_gradient", 1).attribution
    assert not torch.allclose(plain, exact)  # the plain gradient is not exact on DAU nets


class HalfGradient(Rule):
    def backward(self, call, grad_output):
        with torch.enable_grad():
            x = call.inputs[0].detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(call.module(x), x, grad_output)
        return (grad / 2,)


def test_a_core_composite_of_your_own_rules_runs_under_every_attributor():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
    x = torch.randn(5, 3, dtype=torch.float64)
    halved = Composite([(nn.Linear, HalfGradient())])
    plain = explain(model, x, "gradient", 0).attribution
    over = explain(model, x, "gradient", 0, composite=halved).attribution
    torch.testing.assert_close(over, plain / 4)
    integrated = explain(model, x, "integrated_gradients", 0, composite=halved, steps=4)
    reference = explain(model, x, "integrated_gradients", 0, steps=4).attribution
    torch.testing.assert_close(integrated.attribution, reference / 4)


def test_unknown_composites_and_relevance_form_rules_are_refused():
    model = cnn()
    with pytest.raises(InvalidInputError, match="no composite is registered as 'nope'"):
        explain(model, X, "smoothgrad", composite="nope")
    with pytest.raises(InvalidInputError, match="must be a string, a ModifiedGradient or None"):
        explain(model, X, "gradient", composite=3)
    with pytest.raises(InvalidInputError, match="returns relevance, not a gradient"):
        explain(model, X, "gradient", composite=composites.lrp_w2())
