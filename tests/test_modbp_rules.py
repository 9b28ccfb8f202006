"""Each rule against an independent dense-matrix reference built from the layer's Jacobian."""

from collections import OrderedDict

import pytest
import torch
from modbp_nets import reference
from torch import nn

from explain_core import (
    Composite,
    InputLayer,
    InvalidInputError,
    Op,
    Rule,
    UnsupportedModelError,
)
from explain_core.engine import ModifiedBackprop
from explain_modbp import (
    AlphaBeta,
    ContrastiveExcitation,
    Epsilon,
    Excitation,
    Flat,
    Gamma,
    WSquare,
    ZBox,
    Zero,
    ZPlus,
    rules,
)
from explain_modbp.guided import RectifiedReLU

# Tiny float64 layers: thread start-up dominates on the shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


LAYERS = [
    ("linear", lambda b: nn.Linear(7, 5, bias=b), (7,)),
    ("conv1d", lambda b: nn.Conv1d(2, 3, 3, bias=b), (2, 9)),
    ("conv2d", lambda b: nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=b), (2, 6, 5)),
    ("conv2d_groups", lambda b: nn.Conv2d(4, 4, 2, dilation=2, groups=2, bias=b), (4, 5, 5)),
    ("conv2d_1x1_strided", lambda b: nn.Conv2d(4, 6, 1, stride=(2, 3), bias=b), (4, 7, 6)),
    ("conv1d_1_strided_groups", lambda b: nn.Conv1d(4, 6, 1, stride=2, groups=2, bias=b), (4, 7)),
    ("conv3d", lambda b: nn.Conv3d(1, 2, 2, padding=1, bias=b), (1, 3, 4, 3)),
]

RULES = [
    Zero(),
    Epsilon(0.1),
    Gamma(0.25),
    Gamma(0.5, generalised=False),
    ZPlus(),
    ZPlus(bias=True),
    AlphaBeta(2.0, 1.0),
    AlphaBeta(2.0, 1.0, bias=True),
    AlphaBeta(5.0, 4.0),
    Excitation(),
    ContrastiveExcitation(),
]
INPUT_RULES = [WSquare(), Flat(), ZBox(-5.0, 5.0)]


def engine_relevance(model, rule, x, relevance_out, *, first=False):
    composite = Composite([(InputLayer() if first else nn.Module, rule)])
    forward = ModifiedBackprop(composite, record=True).forward(model, x)
    (name,) = forward.layers
    result = forward.backward(start=name, relevance=relevance_out)
    return result.input_signal if result.input_is_relevance else x * result.input_signal


@pytest.mark.parametrize("weights_kept", [True, False], ids=["weights-kept", "weights-remade"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name, make, shape", LAYERS, ids=[entry[0] for entry in LAYERS])
def test_rules_match_matrix_reference(seed, bias, name, make, shape, weights_kept, monkeypatch):
    # A rule keeps its modified weights for the backward pass where they are small, else it
    # makes them again: both ways must give the reference's maps.
    monkeypatch.setattr(rules, "_kept_for_backward", lambda weights, ratio: weights_kept)
    torch.manual_seed(seed)
    layer = make(bias).double().eval()
    if bias:
        nn.init.uniform_(layer.bias, -1, 1)
    for signed in (True, False):  # inputs of both signs, and non-negative (after a ReLU)
        x = torch.randn(3, *shape, dtype=torch.float64)
        x = x if signed else x.abs()
        relevance_out = torch.randn_like(layer(x))
        for rule in RULES:
            got = engine_relevance(layer, rule, x, relevance_out)
            expected = reference(rule, layer, x, relevance_out)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11, msg=repr(rule))
        for rule in INPUT_RULES:
            got = engine_relevance(layer, rule, x, relevance_out, first=True)
            expected = reference(rule, layer, x, relevance_out)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11, msg=repr(rule))


@pytest.mark.parametrize("seed", [0, 1])
def test_merged_batchnorm_matches_reference_of_the_affine_pair(seed):
    torch.manual_seed(seed)
    pair = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3)).double()
    bn = pair[1]
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    nn.init.uniform_(bn.weight, -1.5, 1.5)  # negative scales flip the sign of the weights
    nn.init.uniform_(bn.bias, -1, 1)
    pair.eval()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    relevance_out = torch.randn_like(pair(x))
    rules = (Epsilon(0.01), ZPlus(), ZPlus(bias=True), AlphaBeta(2.0, 1.0, bias=True), Gamma(0.5))
    for rule in rules:
        got = engine_relevance(pair, rule, x, relevance_out)
        torch.testing.assert_close(got, reference(rule, pair, x, relevance_out), msg=repr(rule))


@pytest.mark.parametrize("rule", [Epsilon(0.1), ZPlus(), AlphaBeta(2.0, 1.0)], ids=repr)
def test_rules_work_with_the_core_composite_interface(rule):
    """A core Composite of the rule objects, as a gradient attributor takes it."""
    layer = nn.Conv2d(2, 3, 3, padding=1).double().eval()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    relevance_out = torch.randn_like(layer(x))
    composite = Composite([(nn.Conv2d, rule)])
    _, signal = composite.gradient(layer, x, lambda out: relevance_out / out)
    torch.testing.assert_close(x * signal, reference(rule, layer, x, relevance_out))


@pytest.mark.parametrize(
    "rule", [Zero(), ZPlus(), AlphaBeta(2.0, 1.0), Excitation(), WSquare(), Flat()], ids=repr
)
def test_conserving_rules_conserve_on_one_layer(rule):
    layer = nn.Conv2d(3, 4, 3, padding=1, bias=False).double().eval()
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    relevance_out = torch.rand_like(layer(x))
    got = engine_relevance(layer, rule, x, relevance_out, first=rule.returns_relevance)
    torch.testing.assert_close(got.sum((1, 2, 3)), relevance_out.sum((1, 2, 3)))


def test_alpha_beta_requires_alpha_minus_beta_one():
    with pytest.raises(ValueError, match="alpha - beta must be 1"):
        AlphaBeta(2.0, 2.0)
    with pytest.raises(ValueError, match="epsilon"):
        Epsilon(-1.0)


def test_gamma_on_a_negative_output_matches_hand_computed_values():
    """w = (2, −2.5), x = (1, 1), z = −0.5, γ = 0.25: the paper's ρ(w) = w + γw⁺ = (2.5, −2.5)
    gives a zero denominator; the generalised rule amplifies the negative part instead,
    ρ⁻(w) = (2, −3.125), d = −1.125, R = x ρ⁻(w) / d · z."""
    layer = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[2.0, -2.5]]))
    x = torch.ones(1, 2, dtype=torch.float64)
    z = layer(x).detach()
    got = engine_relevance(layer, Gamma(0.25, epsilon=0.0), x, z)
    expected = torch.tensor([[2.0, -3.125]], dtype=torch.float64) / -1.125 * -0.5
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got.sum(), z.sum())  # conserved
    original = engine_relevance(layer, Gamma(0.25, epsilon=0.0, generalised=False), x, z)
    assert original.abs().max() == 0  # 0/0 → 0: the relevance of z is lost


def test_rule_flags_must_be_booleans():
    with pytest.raises(TypeError, match="bias must be True or False"):
        ZPlus(bias="no")
    with pytest.raises(TypeError, match="generalised must be True or False"):
        Gamma(generalised=1)


class _TwoReaders(nn.Module):
    """``a``'s output is read by a ReLU and by an addition, ``b``'s by an in-place ReLU only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.b = nn.Conv2d(3, 3, 1)
        self.fc = nn.Linear(48, 2)

    def forward(self, x):
        z = self.a(x)
        h = torch.relu(z) + z
        return self.fc(torch.flatten(self.b(h).relu_(), 1))


class _PassEverything(Rule):
    """A module rule that passes the signal where the ReLU is off, too."""

    def backward(self, call, grad_output):
        return (grad_output,)


def test_a_layer_is_rectified_only_when_a_relu_alone_reads_its_output():
    model = _TwoReaders().double().eval()
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    forward = ModifiedBackprop(Composite([(nn.Module, Gamma())])).forward(model, x)
    assert forward.plan.rectified == {"b"}  # not a (also added), nor fc (the model output)
    # a composite with its own ReLU rule (Guided BP) may pass signal where a ReLU is off
    guided = Composite([(nn.Module, Gamma()), (Op("relu", "relu_"), RectifiedReLU("guided"))])
    assert ModifiedBackprop(guided).forward(model, x).plan.rectified == set()
    # nor one with a rule for ReLU modules (here one named "relu", as the operation is)
    named = nn.Sequential(
        OrderedDict(conv=nn.Conv2d(2, 3, 3), relu=nn.ReLU(), flat=nn.Flatten(), fc=nn.Linear(12, 2))
    ).double()
    assert ModifiedBackprop(Composite([(nn.Module, Gamma())])).forward(named, x).plan.rectified == {
        "conv"
    }
    passing = Composite([(nn.ReLU, _PassEverything()), (nn.Module, Gamma())])
    assert ModifiedBackprop(passing).forward(named, x).plan.rectified == set()


def _conv_bn_relu(inplace: bool) -> nn.Module:
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(inplace=inplace)
    )
    nn.init.uniform_(model[1].running_mean, -0.5, 0.5)
    return model.append(nn.Flatten()).append(nn.Linear(48, 4)).double().eval()


def _autograd_nodes(tensor: torch.Tensor) -> list[str]:
    """The names of the autograd nodes ``tensor`` was computed through."""
    names, pending, seen = [], [tensor.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_a_rule_on_a_layer_only_a_relu_reads_matches_the_matrix_reference(inplace, signed, rule):
    """Rules that mask the outputs a ReLU stops themselves (ε, γ, αβ, z⁺) have the ReLU passed.

    The ReLU then leaves no node in the graph: its backward would only repeat the rule's mask.
    The map is still the rule's (its reference knows nothing of that).
    """
    model = _conv_bn_relu(inplace)
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    x = x if signed else x.abs()
    forward = ModifiedBackprop(Composite([(nn.Module, rule)])).forward(model, x)
    assert forward.plan.rectified == {"0"} and forward.plan.merged == {"0": "1"}
    passed = "ReluBackward0" not in _autograd_nodes(forward.output)
    assert passed == rule.uses_rectified_outputs
    target = torch.nn.functional.one_hot(torch.tensor([0, 3, 1]), 4).double()
    got = x * forward.backward(target).input_signal
    z = model[1](model[0](x)).detach()
    a = z.clamp(min=0).flatten(1)
    relevance_a = reference(rule, model[4], a, target * model[4](a).detach())
    expected = reference(rule, model[:2], x, relevance_a.reshape(z.shape))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


READING_THE_RELU = [Epsilon(0.1), Gamma(0.25), ZPlus(), AlphaBeta(2.0, 1.0)]


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("rule", READING_THE_RELU, ids=repr)
def test_a_rule_on_a_layer_only_a_relu_reads_keeps_that_relus_output_not_a_ratio(inplace, rule):
    """Its per-output factors come from the ReLU's own output in backward (no tensor the size
    of the output is kept from forward; the model keeps the ReLU's output anyway)."""
    model = _conv_bn_relu(inplace)
    seen: list[torch.Tensor] = []
    model[2].register_forward_hook(lambda module, args, output: seen.append(output))
    x = torch.rand(2, 2, 4, 4, dtype=torch.float64)
    forward = ModifiedBackprop(Composite([(nn.Module, rule)]), record=True).forward(model, x)
    call = forward.records["0"].call
    assert rule.reads_rectified_output(call)
    assert call.rectified_output.data_ptr() == seen[-1].data_ptr()  # the pass's ReLU, no copy
    kept = [t for t in torch.utils._pytree.tree_leaves(call.state) if isinstance(t, torch.Tensor)]
    assert all(t.numel() < seen[-1].numel() for t in kept)


class _ChangedAfterReLU(nn.Module):
    """conv → ReLU, whose output forward then doubles in place, → linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(48, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        h.mul_(2.0)
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("rule", READING_THE_RELU, ids=repr)
def test_a_relu_output_a_rule_reads_changed_in_place_later_is_refused_as_autograd_does(rule):
    torch.manual_seed(0)
    model = _ChangedAfterReLU().double().eval()
    x = torch.rand(2, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(model(x).sum(), x)  # the ReLU keeps its output for its gradient
    forward = ModifiedBackprop(Composite([(nn.Module, rule)])).forward(model, x)
    assert forward.plan.rectified == {"conv"}
    with pytest.raises(UnsupportedModelError, match="'conv' was changed in place later in forward"):
        forward.backward(torch.ones(2, 2, dtype=torch.float64))


class _TwoReaderModules(_TwoReaders):
    """:class:`_TwoReaders` with ReLU modules."""

    def __init__(self) -> None:
        super().__init__()
        self.relu, self.relu_b = nn.ReLU(), nn.ReLU(inplace=True)

    def forward(self, x):
        z = self.a(x)
        h = self.relu(z) + z
        return self.fc(torch.flatten(self.relu_b(self.b(h)), 1))


@pytest.mark.parametrize("net", [_TwoReaders, _TwoReaderModules])
def test_a_relu_after_a_masking_rule_is_passed_only_where_only_relus_read(net):
    """A ReLU whose input another operation also reads keeps its backward."""
    model = net().double().eval()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    forward = ModifiedBackprop(Composite([(nn.Module, ZPlus())])).forward(model, x)
    assert forward.plan.rectified == {"b"}
    assert _autograd_nodes(forward.output).count("ReluBackward0") == 1  # a's, not b's
    target = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    got = x * forward.backward(target).input_signal
    with torch.no_grad():  # layer by layer: z⁺ at the layers, the gradient elsewhere
        z_a = model.a(x)
        h = z_a.relu() + z_a
        z_b = model.b(h)
        a_b = z_b.relu().flatten(1)
        relevance_b = reference(ZPlus(), model.fc, a_b, target * model.fc(a_b))
        signal_h = reference(ZPlus(), model.b, h, relevance_b.reshape(z_b.shape)) / h
        signal_z = signal_h * ((z_a > 0).double() + 1)  # through the ReLU and the sum
    expected = reference(ZPlus(), model.a, x, z_a * signal_z)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("rule", [Gamma(0.25), ZPlus(), AlphaBeta(2.0, 1.0)], ids=repr)
def test_a_signal_injected_at_a_rectified_layer_must_be_zero_where_the_relu_is_off(rule):
    model = _conv_bn_relu(inplace=False)
    x = torch.rand(2, 2, 4, 4, dtype=torch.float64)
    forward = ModifiedBackprop(Composite([(nn.Module, rule)]), record=True).forward(model, x)
    z = model[1](model[0](x)).detach()
    signal = torch.randn_like(z)
    with pytest.raises(InvalidInputError, match="inject relevance instead"):
        forward.backward(signal, start="0", retain_graph=True)
    masked = signal * (z > 0)
    got = x * forward.backward(masked, start="0").input_signal
    expected = reference(rule, model[:2], x, z * masked)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
