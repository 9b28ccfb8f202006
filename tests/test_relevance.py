import copy

import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import Composite, InputLayer, OutputLayer, Rule, RuleCall


class Epsilon(Rule):
    """LRP-ε written against the rule interface (signal = relevance)."""

    def __init__(self, epsilon: float = 1e-6) -> None:
        self.epsilon = epsilon

    def backward(self, call: RuleCall, grad_output):
        (x,) = call.inputs
        x = x.detach().requires_grad_(True)
        z = call.module(x)
        stabilised = z + self.epsilon * torch.where(z >= 0, 1.0, -1.0).to(z)
        (c,) = torch.autograd.grad(z, x, grad_output / stabilised)
        return (x.detach() * c,)


class Boom(Rule):
    def backward(self, call, grad_output):
        raise RuntimeError("rule failed")


def linear_map(module: nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    """The layer's Jacobian without bias: the matrix the rule must be consistent with."""
    zero = torch.zeros(1, *input_shape, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(
        lambda t: module(t) - module(zero), zero
    )  # (1, *out, 1, *in)
    out_numel = jac[0].numel() // zero.numel()
    return jac.reshape(out_numel, zero.numel())


def epsilon_reference(module, x, relevance_out, epsilon):
    """Matrix-form LRP-ε: R_i = Σ_j x_i W_ji R_j / (z_j + ε sign z_j)."""
    w = linear_map(module, tuple(x.shape[1:]))
    flat_x = x.reshape(x.shape[0], -1)
    z = module(x).reshape(x.shape[0], -1)
    stabilised = z + epsilon * torch.where(z >= 0, 1.0, -1.0).double()
    contributions = flat_x[:, None, :] * w[None]  # (B, out, in)
    r = (contributions * (relevance_out.reshape(x.shape[0], -1) / stabilised)[:, :, None]).sum(1)
    return r.reshape(x.shape)


def propagate(model, composite, x, relevance_out):
    return composite.gradient(model, x, lambda out: relevance_out)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda b: nn.Linear(7, 5, bias=b), (7,)),
        (lambda b: nn.Conv1d(2, 3, 3, bias=b), (2, 9)),
        (lambda b: nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=b), (2, 6, 5)),
        (lambda b: nn.Conv3d(1, 2, 2, bias=b), (1, 3, 4, 3)),
    ],
)
def test_rule_through_composite_matches_matrix_reference(seed, bias, make, shape):
    torch.manual_seed(seed)
    layer = make(bias).double().eval()
    x = torch.randn(3, *shape, dtype=torch.float64)
    relevance_out = torch.randn_like(layer(x))
    _, r = propagate(layer, Composite([(type(layer), Epsilon(0.1))]), x, relevance_out)
    expected = epsilon_reference(layer, x, relevance_out, 0.1)
    torch.testing.assert_close(r, expected, rtol=1e-10, atol=1e-12)


def test_two_layer_network_conserves_relevance_without_bias():
    model = (
        nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False))
        .double()
        .eval()
    )
    x = torch.randn(4, 6, dtype=torch.float64)
    out = model(x)
    start = torch.zeros_like(out)
    start[:, 1] = out[:, 1]
    _, r = propagate(model, Composite([(nn.Linear, Epsilon(1e-12))]), x, start.detach())
    torch.testing.assert_close(r.sum(1), out[:, 1].detach(), rtol=1e-8, atol=1e-10)
    # LRP-0 equals Input×Gradient on a ReLU network.
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(xg)[:, 1].sum(), xg)
    torch.testing.assert_close(r, (x * grad) * 1.0, rtol=1e-8, atol=1e-10)


def cnn_with_batchnorm():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
        nn.BatchNorm1d(3),
    )
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    model.keep_me = "user attribute"
    return model.double().eval()


def test_composite_leaves_model_bit_identical_after_use_and_after_exceptions():
    model = cnn_with_batchnorm()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    expected_out = model(x).detach()
    before = state_fingerprint(model)
    every_layer = (nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.BatchNorm1d)
    composite = Composite([(every_layer, Epsilon())], canonizers=())
    out, _ = propagate(model, composite, x, torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    assert_same_state(before, state_fingerprint(model))

    failing = Composite([(nn.Linear, Boom()), (every_layer, Epsilon())], canonizers=())
    with pytest.raises(RuntimeError, match="rule failed"):
        propagate(model, failing, x, torch.ones(2, 3, dtype=torch.float64))
    assert_same_state(before, state_fingerprint(model))
    torch.testing.assert_close(model(x), expected_out, rtol=0, atol=0)


def test_a_reused_module_gets_its_rule_at_every_call():
    shared = nn.Linear(4, 4).double()
    model = nn.Sequential(shared, nn.ReLU(), shared).eval()
    copies = nn.Sequential(shared, nn.ReLU(), copy.deepcopy(shared)).eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    composite, start = Composite([(nn.Linear, Epsilon(0.1))]), torch.ones(2, 4).double()
    expected = propagate(copies, composite, x, start)
    torch.testing.assert_close(propagate(model, composite, x, start), expected)
    assert not shared._forward_hooks and not shared._forward_pre_hooks


def test_every_pass_is_explained_on_its_own():
    model = nn.Sequential(nn.Linear(3, 2)).double().eval()
    composite = Composite([(nn.Linear, Epsilon(0.5))])
    for seed in range(2):
        x = torch.randn(1, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        start = torch.ones(1, 2, dtype=torch.float64)
        _, r = propagate(model, composite, x, start)
        torch.testing.assert_close(r, epsilon_reference(model[0], x, start, 0.5))


def test_matchers_by_name_predicate_type_and_position():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    rule_a, rule_b, rule_c, rule_d = Epsilon(1.0), Epsilon(2.0), Epsilon(3.0), Epsilon(4.0)
    by_name = Composite([("2", rule_a), (nn.Linear, rule_b)])
    assert [by_name.rule_for(n, model.get_submodule(n)) for n in "012"] == [rule_b, None, rule_a]
    by_predicate = Composite([(lambda name, m: getattr(m, "out_features", 0) == 2, rule_c)])
    assert by_predicate.rule_for("2", model[2]) is rule_c
    assert by_predicate.rule_for("0", model[0]) is None
    # positions come first, whatever the order of the entries
    positioned = Composite([(nn.Linear, rule_b), (InputLayer(), rule_a), (OutputLayer(), rule_d)])
    assert positioned.rule_for("0", model[0], reads_input=True) is rule_a
    assert positioned.rule_for("2", model[2], is_output=True) is rule_d
    assert positioned.rule_for("2", model[2]) is rule_b
