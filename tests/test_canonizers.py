"""Canonizers: core objects the engine applies to its traced layers; the model never changes."""

import copy

import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import Composite, MergeBatchNorm, Rule, explain
from explain_core.canonizers import Canonizer, TracedLayers
from explain_core.engine import ModifiedBackprop
from explain_core.errors import ModelStateError, UnsupportedModelError
from explain_modbp import Epsilon, ZPlus
from explain_modbp.composites import lrp_epsilon_plus

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def conv_bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
        nn.BatchNorm1d(5),
    ).double()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.3, 0.3)
    return model.eval()


def folded_by_hand(model: nn.Sequential) -> nn.Sequential:
    """The same function with each BatchNorm folded into the layer before it (the reference)."""
    layers = []
    modules = list(copy.deepcopy(model))
    for module in modules:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            layer = layers[-1]
            scale = module.weight / torch.sqrt(module.running_var + module.eps)
            shape = (-1,) + (1,) * (layer.weight.dim() - 1)
            bias = layer.bias if layer.bias is not None else torch.zeros_like(scale)
            folded = type(layer)(*_sizes(layer), bias=True).double()
            if isinstance(layer, nn.Conv2d):
                folded.padding = layer.padding
            folded.weight.data = layer.weight.data * scale.reshape(shape)
            folded.bias.data = (bias.data - module.running_mean) * scale + module.bias.data
            layers[-1] = folded
        else:
            layers.append(module)
    return nn.Sequential(*layers).eval()


def _sizes(layer: nn.Module) -> tuple:
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    return layer.in_channels, layer.out_channels, layer.kernel_size


def test_merge_batchnorm_folds_only_a_batchnorm_that_alone_reads_a_linear_or_conv():
    conv, bn, relu_bn, lin, bn3d = (
        nn.Conv2d(1, 2, 3),
        nn.BatchNorm2d(2),
        nn.BatchNorm2d(2),
        nn.Linear(2, 2),
        nn.BatchNorm1d(2),
    )
    layers = TracedLayers(
        ["conv", "bn", "other", "lin", "bn3d"],
        {"conv": conv, "bn": bn, "other": relu_bn, "lin": lin, "bn3d": bn3d},
        reads={"bn": "conv", "bn3d": "lin"},  # "other" reads a ReLU's output
        input_dims={"bn": 4, "other": 4, "bn3d": 3},  # a (batch, tokens, features) Linear
    )
    MergeBatchNorm().apply(layers)
    assert layers.merged == {"conv": "bn"}


def test_the_engine_applies_the_canonizer_and_equals_a_model_folded_by_hand():
    model = conv_bn_net()
    reference_model = folded_by_hand(model)
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(reference_model(x), model(x), rtol=1e-12, atol=1e-12)
    before = state_fingerprint(model)

    merged = explain(model, x, "lrp.epsilon_plus", target=1).attribution
    expected = explain(reference_model, x, "lrp.epsilon_plus", target=1).attribution
    torch.testing.assert_close(merged, expected, rtol=1e-10, atol=1e-12)
    assert_same_state(before, state_fingerprint(model))  # nothing was folded into the model

    plan = ModifiedBackprop(lrp_epsilon_plus()).forward(model, x).plan
    assert plan.merged == {"0": "1", "3": "4", "7": "8"}


class Siamese(nn.Module):
    """One branch (conv, BatchNorm, ReLU) on both halves of the input, a head on both outputs.

    ``interleaved`` runs the branch's first layer on both halves before the rest on either.
    """

    def __init__(self, branch: nn.Sequential, head: nn.Module, interleaved: bool = False) -> None:
        super().__init__()
        self.branch, self.head, self.interleaved = branch, head, interleaved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right = x[:, :3], x[:, 3:]
        if self.interleaved:
            first, rest = self.branch[0], self.branch[1:]
            left, right = first(left), first(right)
            left, right = rest(left), rest(right)
        else:
            left, right = self.branch(left), self.branch(right)
        return self.head(torch.cat([left, right], dim=1).flatten(1))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("method", ["lrp.epsilon_plus", "lrp.alpha2beta1", "lrp.epsilon"])
def test_a_shared_conv_and_its_batchnorm_are_folded_at_every_call(interleaved, method):
    branch = conv_bn_net()[:3]
    head = nn.Linear(2 * 6 * 8 * 8, 4).double()
    model = Siamese(branch, head, interleaved).eval()
    reference_model = Siamese(folded_by_hand(branch), head, interleaved).eval()
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(reference_model(x), model(x), rtol=1e-12, atol=1e-12)
    before = state_fingerprint(model)

    merged = explain(model, x, method, target=1).attribution
    expected = explain(reference_model, x, method, target=1).attribution
    assert expected.abs().sum() > 0
    torch.testing.assert_close(merged, expected, rtol=1e-10, atol=1e-12)
    assert_same_state(before, state_fingerprint(model))
    plan = ModifiedBackprop(lrp_epsilon_plus()).forward(model, x).plan
    assert plan.merged == {"branch.0": "branch.1"} and plan.calls["branch.1"] == 2


def test_a_shared_conv_followed_by_its_batchnorm_in_some_calls_only_is_not_folded():
    norm = conv_bn_net()[4]  # four channels, with random statistics
    conv = nn.Conv2d(4, 4, 3, padding=1, bias=False).double()
    model = nn.Sequential(conv, norm, nn.ReLU(), conv, nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
    model = model.double().eval()
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    # folding would give the second call the BatchNorm's scale too: the pair stays two layers
    rules = [((nn.Conv2d,), ZPlus()), ((nn.Linear,), Epsilon())]
    with pytest.raises(UnsupportedModelError, match=r"no rule for module '1' \(BatchNorm2d\)"):
        ModifiedBackprop(Composite(rules)).forward(model, x)
    own_rule = Composite([*rules, (nn.modules.batchnorm._BatchNorm, Epsilon())])
    forward = ModifiedBackprop(own_rule).forward(model, x)
    assert forward.plan.merged == {} and forward.plan.calls == {"0": 2}


def test_without_the_canonizer_each_batchnorm_is_a_layer_of_its_own():
    model = conv_bn_net()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    rules = [((nn.Conv2d,), ZPlus()), ((nn.Linear,), Epsilon())]
    unmerged = Composite(rules, canonizers=())
    with pytest.raises(UnsupportedModelError, match=r"no rule for module '1' \(BatchNorm2d\)"):
        ModifiedBackprop(unmerged).forward(model, x)

    own_rule = Composite([*rules, (nn.modules.batchnorm._BatchNorm, Epsilon())], canonizers=())
    forward = ModifiedBackprop(own_rule).forward(model, x)
    assert forward.plan.merged == {} and forward.plan.order == [str(i) for i in (0, 1, 3, 4, 7, 8)]
    select = torch.zeros_like(forward.output)
    select[:, 1] = 1
    separate = x * forward.backward(select).input_signal
    merged = explain(model, x, "lrp.epsilon_plus", target=1).attribution
    assert not torch.allclose(separate, merged)  # z⁺ on a BatchNorm's scale is not z⁺ merged


def test_a_canonizer_of_ones_own_steers_the_engine():
    class MergeFirstOnly(Canonizer):
        def apply(self, layers: TracedLayers) -> None:
            MergeBatchNorm().apply(layers)
            layers.merged = {k: v for k, v in layers.merged.items() if k == "0"}

    model = conv_bn_net()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    composite = Composite(
        [(nn.Conv2d, ZPlus()), (nn.Linear, Epsilon()), (nn.BatchNorm2d, Epsilon())],
        canonizers=[MergeFirstOnly()],
    )
    with pytest.raises(UnsupportedModelError, match=r"no rule for module '8' \(BatchNorm1d\)"):
        ModifiedBackprop(composite).forward(model, x)
    composite = composite.with_rules((nn.BatchNorm1d, Epsilon()))
    assert ModifiedBackprop(composite).forward(model, x).plan.merged == {"0": "1"}


def test_a_batchnorm_in_training_mode_is_refused_and_the_model_left_as_it_was():
    model = conv_bn_net()
    model[1].train()
    before = state_fingerprint(model)
    with pytest.raises(ModelStateError, match="training mode"):
        ModifiedBackprop(lrp_epsilon_plus()).forward(model, torch.randn(2, 3, 8, 8).double())
    assert_same_state(before, state_fingerprint(model))


def test_a_rule_that_runs_the_module_itself_is_not_given_a_folded_layer():
    class Doubled(Rule):  # runs the module as called: it would miss the folded BatchNorm
        def backward(self, call, grad_output):
            x = call.inputs[0].detach().requires_grad_(True)
            with torch.enable_grad():
                (grad,) = torch.autograd.grad(call.module(x), x, grad_output)
            return (2 * grad,)

    model = conv_bn_net()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    composite = lrp_epsilon_plus().with_rules(("0", Doubled()))
    with pytest.raises(UnsupportedModelError, match=r"folded BatchNorm '1' into it"):
        ModifiedBackprop(composite).forward(model, x)
