"""Rules for traced operations, mapped by composites (``Op(...)``), against hand-written formulas.

A rule of one's own goes through the public API exactly as the built-in ones do: LRP's pass rule
for activations (``PassRelevance``) and Guided BP's rectified ReLU (``RectifiedReLU``) are such
operation rules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from explain_core import Composite, InvalidInputError, Rule, UnsupportedModelError, explain
from explain_core.interfaces.relevance import Op
from explain_modbp import composites
from explain_modbp.activations import PassRelevance


class PassThrough(Rule):
    """Relevance passes an element-wise activation unchanged: ``s_x = s_y · f(x) / x``."""

    def forward(self, call):
        (x,) = call.inputs
        return call.output / x

    def backward(self, call, grad_output):
        return (grad_output * call.state,)


class Halved(Rule):
    """The activation's own derivative, halved (a rule that is not LRP's)."""

    def forward(self, call):
        (x,) = call.inputs
        return 1 - torch.tanh(x) ** 2

    def backward(self, call, grad_output):
        return (grad_output * call.state / 2,)


def tanh_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6, bias=False), nn.Tanh(), nn.Linear(6, 3, bias=False))


X = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def hand_signal(model: nn.Module, x: torch.Tensor, k: int, gate: torch.Tensor) -> torch.Tensor:
    """``W1ᵀ (gate ⊙ W2ᵀ e_k)``: LRP-0 on both Linear layers, ``gate`` at the tanh."""
    w1, w2 = model[0].weight, model[2].weight
    return (gate * w2[k]) @ w1


@pytest.mark.parametrize("rule", [PassThrough(), PassRelevance()])
def test_a_pass_rule_for_tanh_equals_the_formula_and_conserves(rule):
    model = tanh_net().double().eval()
    composite = composites.lrp_z().with_rules((Op("tanh"), rule))
    result = explain(model, X, "lrp.custom", 2, composite=composite)
    z = model[0](X)
    expected = X * hand_signal(model, X, 2, torch.tanh(z) / z)
    torch.testing.assert_close(result.attribution, expected.detach(), rtol=1e-12, atol=1e-14)
    # bias-free: LRP-0 with relevance passed through the activation sums to the logit
    torch.testing.assert_close(
        result.delta, torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0
    )


def test_an_operation_rule_of_ones_own_replaces_the_gradient_there():
    model = tanh_net().double().eval()
    composite = composites.lrp_z().with_rules((Op("tanh"), Halved()))
    result = explain(model, X, "gradient", 1, composite=composite)
    z = model[0](X)
    expected = hand_signal(model, X, 1, (1 - torch.tanh(z) ** 2) / 2)
    torch.testing.assert_close(result.attribution, expected.detach(), rtol=1e-12, atol=1e-14)


def test_the_lrp_presets_pass_activations_and_excitation_refuses_them():
    model = tanh_net().double().eval()
    assert composites.lrp_epsilon().op_kinds >= {"tanh", "gelu", "silu", "sigmoid"}
    result = explain(model, X, "lrp.z", 0)
    z = model[0](X)
    expected = X * hand_signal(model, X, 0, torch.tanh(z) / z)
    torch.testing.assert_close(result.attribution, expected.detach(), rtol=1e-12, atol=1e-14)
    with pytest.raises(Exception, match="operation 'tanh'"):
        explain(model, X, "excitation_bp", 0)


def test_lrp_custom_adds_or_removes_the_activation_rule_as_asked():
    model = tanh_net().double().eval()
    bare = Composite([(nn.Linear, composites.rules.Zero())])
    passed = explain(model, X, "lrp.custom", 0, composite=bare).attribution
    torch.testing.assert_close(passed, explain(model, X, "lrp.z", 0).attribution)
    with pytest.raises(Exception, match="operation 'tanh'"):
        explain(model, X, "lrp.custom", 0, composite=composites.lrp_z(), activations=False)


def test_op_needs_operation_names():
    with pytest.raises(InvalidInputError, match="operation names"):
        Op()
    assert Op("gelu", "silu") == Op("silu", "gelu")


class SignalTakesAll(Rule):
    """A product ``signal · gate``: all relevance to the signal (``R_s = R_y``), none to the gate.

    In the signal convention ``s_signal = s_y · gate``, ``s_gate = 0``.
    """

    def backward(self, call, grad_output):
        gate = call.inputs[1]
        return grad_output * gate, torch.zeros_like(gate)


class Uniform(Rule):
    """A product ``a · b`` of two activations: half the relevance to each, ``R_a = R_b = R_y/2``."""

    def backward(self, call, grad_output):
        a, b = call.inputs
        return grad_output * b / 2, grad_output * a / 2


class Gated(nn.Module):
    """``W2 (h · σ(V h))`` with ``h = W1 x``: a squeeze-excitation-like gate, bias-free."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.w1, self.v, self.w2 = nn.Linear(5, 6, bias=False), nn.Linear(6, 6), nn.Linear(6, 3)
        self.w2.bias = None

    def forward(self, x):
        h = self.w1(x)
        return self.w2(h * torch.sigmoid(self.v(h)))


def test_a_product_rule_sees_both_factors_and_gives_the_gate_nothing():
    model = Gated().double().eval()
    k = 1
    composite = composites.lrp_z().with_rules((Op("mul"), SignalTakesAll()))
    result = explain(model, X, "lrp.custom", k, composite=composite)
    # by hand: LRP-0 on W2 and W1, the gate a constant: R = x ⊙ W1ᵀ (σ(V h) ⊙ W2ᵀ e_k)
    with torch.no_grad():
        gate = torch.sigmoid(model.v(model.w1(X)))
    expected = X * ((gate * model.w2.weight[k]) @ model.w1.weight)
    torch.testing.assert_close(result.attribution, expected)
    torch.testing.assert_close(result.delta, torch.zeros(4, dtype=torch.float64))  # conserved


def test_the_uniform_rule_splits_a_product_of_two_activations_in_half():
    class Bilinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(3)
            self.a, self.b = nn.Linear(5, 4, bias=False), nn.Linear(5, 4, bias=False)

        def forward(self, x):
            return self.a(x) * self.b(x)

    model = Bilinear().double().eval()
    composite = composites.lrp_z().with_rules((Op("mul"), Uniform()))
    result = explain(model, X, "lrp.custom", 2, composite=composite)
    with torch.no_grad():
        half = model.a(X)[:, 2] * model.b(X)[:, 2] / 2  # R_a = R_b = R_y / 2 at output 2
        by_a = X * (half / model.a(X)[:, 2])[:, None] * model.a.weight[2]
        by_b = X * (half / model.b(X)[:, 2])[:, None] * model.b.weight[2]
    torch.testing.assert_close(result.attribution, by_a + by_b)
    torch.testing.assert_close(result.delta, torch.zeros(4, dtype=torch.float64))


def test_the_presets_gate_rule_is_signal_take_all_and_refuses_products_without_a_gate():
    model = Gated().double().eval()
    k = 1
    result = explain(model, X, "lrp.z", k)  # the presets hold a sigmoid gate constant
    with torch.no_grad():
        gate = torch.sigmoid(model.v(model.w1(X)))
    torch.testing.assert_close(
        result.attribution, X * ((gate * model.w2.weight[k]) @ model.w1.weight)
    )

    class Squared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(5, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            return self.b(h * h)  # no activation made either factor: no gate to hold

    with pytest.raises(InvalidInputError, match=r"neither \(or both alike\) returned by an"):
        explain(Squared().double().eval(), X, "lrp.z", 0)
    with pytest.raises(InvalidInputError, match=r"'sigmoid' .* is an activation this pass has"):
        explain(model, X, "excitation_bp", 0)  # Excitation BP refuses activations and gates


def test_tensors_a_rule_keeps_are_checked_for_in_place_changes():
    """Kept by reference: an output changed later is computed again, a changed input refused."""
    from explain_core.errors import UnsupportedModelError
    from explain_modbp.transformer import lrp_attn

    class Later(nn.Module):
        def __init__(self, change: str) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.change = nn.Linear(4, 4), nn.Linear(4, 2), change

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            y = F.gelu(h)  # the pass rule reads h and y in backward
            (y if self.change == "output" else h).mul_(2.0)
            return self.b(y)

    x = torch.randn(3, 4, dtype=torch.float64)
    model = Later("output").double().eval()
    got = explain(model, x, "gradient", 1, composite=lrp_attn()).attribution
    h = model.a(x).detach()
    expected = (2.0 * model.b.weight[1] * (F.gelu(h) / h)) @ model.a.weight  # R passes GELU
    torch.testing.assert_close(got, expected.detach())
    with pytest.raises(UnsupportedModelError, match="changed in place later in forward"):
        explain(Later("input").double().eval(), x, "gradient", 1, composite=lrp_attn())


@pytest.mark.parametrize(
    ("clamp", "advice"),
    [((0.0, 6.0), "F.relu6"), ((-1.0, 1.0), "F.hardtanh"), ((1e-6, None), "clamp away from 0")],
)
def test_a_clamp_is_refused_with_the_activation_it_may_be_and_how_to_give_it_a_rule(clamp, advice):
    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.head = nn.Conv2d(1, 2, 3), nn.Linear(2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.conv(x).clamp(*clamp).mean((2, 3)))

    with pytest.raises(UnsupportedModelError) as error:
        explain(Clamped().eval(), torch.rand(2, 1, 5, 5), "lrp.epsilon", 0)
    assert advice in str(error.value)
    assert "composite.with_rules((explain_core.Op('clamp'), MyRule()))" in str(error.value)


class GatedLinear(nn.Module):
    """A gated linear unit, ``F.glu`` or written by hand as ``a * sigmoid(b)``."""

    def __init__(self, by_hand: bool) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.by_hand = by_hand
        self.up, self.head = nn.Linear(4, 8), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.up(x)
        if self.by_hand:
            signal, gate = z.chunk(2, -1)
            return self.head(signal * torch.sigmoid(gate))
        return self.head(F.glu(z, -1))


@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.zplus", "lrp.attn", "lrp.cp"])
def test_f_glu_is_explained_as_its_gate_written_by_hand(method):
    # F.glu was refused ("'glu' has no relevance rule") by every rule-based method
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = explain(GatedLinear(True).double().eval(), x, method, 1).attribution
    assert expected.abs().sum() > 0
    got = explain(GatedLinear(False).double().eval(), x, method, 1).attribution
    torch.testing.assert_close(got, expected)


class TimeSums(nn.Module):
    """A 1-d CNN whose features are summed up over time (cumsum) or differenced (diff)."""

    def __init__(self, op: str, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.op = op
        self.conv = nn.Conv1d(2, 3, 3, bias=bias)
        self.head = nn.Linear(3 * (6 if op == "cumsum" else 5), 2, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        h = h.cumsum(-1) if self.op == "cumsum" else torch.diff(h, dim=-1)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("op", ["cumsum", "diff"])
def test_cumsum_and_diff_are_the_linear_maps_they_are(op):
    # both were refused ("has no relevance rule") by every rule-based method
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    model = TimeSums(op).double().eval()
    lrp_zero = explain(model, x, "lrp.z", 1).attribution  # = Input×Gradient on a ReLU net
    torch.testing.assert_close(lrp_zero, explain(model, x, "input_x_gradient", 1).attribution)
    bias_free = TimeSums(op, bias=False).double().eval()
    delta = explain(bias_free, x, "lrp.zplus", 1).delta  # z⁺ conserves, also at signed inputs
    torch.testing.assert_close(delta, torch.zeros(3, dtype=torch.float64), atol=1e-10, rtol=0)
    reference = torch.randn(3, 2, 8, dtype=torch.float64)
    rescale = explain(model, x, "deeplift.rescale", 1, baselines=reference)
    with torch.no_grad():
        gain = model(x)[:, 1] - model(reference)[:, 1]
    torch.testing.assert_close(rescale.attribution.sum((1, 2)), gain)
