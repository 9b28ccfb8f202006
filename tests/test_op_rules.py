"""Rules for traced operations, mapped by composites (``Op(...)``), against hand-written formulas.

A rule of one's own goes through the public API exactly as the built-in ones do: LRP's pass rule
for activations (``PassRelevance``) and Guided BP's rectified ReLU (``RectifiedReLU``) are such
operation rules.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from explain_core import Composite, InvalidInputError, Rule, explain
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
