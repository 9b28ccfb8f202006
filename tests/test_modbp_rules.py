"""Each rule against an independent dense-matrix reference built from the layer's Jacobian."""

import pytest
import torch
from torch import nn

from explain_core import Composite
from explain_modbp import (
    AlphaBeta,
    ContrastiveExcitation,
    Epsilon,
    Excitation,
    Flat,
    Gamma,
    LayerComposite,
    ModifiedBackprop,
    WSquare,
    ZBox,
    Zero,
    ZPlus,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny float64 layers: thread start-up dominates on the shared 2-core machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def dense(layer: nn.Module, shape: tuple[int, ...]):
    """Weight matrix W (out × in) and bias vector b (out) of an affine layer, from its Jacobian."""
    n = int(torch.tensor(shape).prod())
    with torch.no_grad():
        zero = layer(torch.zeros(1, *shape, dtype=torch.float64)).reshape(-1)
        basis = torch.eye(n, dtype=torch.float64).reshape(n, *shape)
        columns = layer(basis).reshape(n, -1) - zero
    return columns.T.contiguous(), zero


def reference(rule, layer, x, relevance_out):
    """Matrix-form relevance R_i = Σ_j num_ij / den_j · R_j, per rule."""
    w, b = dense(layer, tuple(x.shape[1:]))
    flat_x = x.reshape(x.shape[0], -1)
    r = relevance_out.reshape(x.shape[0], -1)
    contributions = flat_x[:, None, :] * w[None]  # (batch, out, in): x_i W_ji
    wp, wn = w.clamp(min=0), w.clamp(max=0)

    def spread(num, den):
        safe = torch.where(den == 0, torch.ones_like(den), den)
        return (num * torch.where(den == 0, 0.0, r / safe)[:, :, None]).sum(1)

    if isinstance(rule, Epsilon):
        z = contributions.sum(2) + b
        den = z + rule.epsilon * torch.where(z >= 0, 1.0, -1.0).double()
        out = spread(contributions, den)
    elif isinstance(rule, Gamma):
        rho_w = w + rule.gamma * wp
        # the bias of the dense reference is b itself (per output position)
        rho_b = b + rule.gamma * b.clamp(min=0)
        num = flat_x[:, None, :] * rho_w[None]
        z = num.sum(2) + rho_b
        out = spread(num, z + rule.epsilon * torch.where(z >= 0, 1.0, -1.0).double())
    elif isinstance(rule, AlphaBeta):
        pos, neg = contributions.clamp(min=0), contributions.clamp(max=0)
        out = rule.alpha * spread(pos, pos.sum(2))
        if rule.beta:
            out = out - rule.beta * spread(neg, neg.sum(2))
    elif isinstance(rule, WSquare):
        num = (w**2)[None].expand_as(contributions)
        out = spread(num, num.sum(2))
    elif isinstance(rule, Flat):
        num = (w != 0).double()[None].expand_as(contributions)
        out = spread(num, num.sum(2))
    elif isinstance(rule, ZBox):
        low = torch.full_like(flat_x, rule.low)
        high = torch.full_like(flat_x, rule.high)
        num = contributions - low[:, None, :] * wp[None] - high[:, None, :] * wn[None]
        out = spread(num, num.sum(2))
    elif isinstance(rule, ContrastiveExcitation):
        pos = flat_x[:, None, :] * wp[None]
        neg = flat_x[:, None, :] * (-w).clamp(min=0)[None]
        out = spread(pos, pos.sum(2)) - spread(neg, neg.sum(2))
    elif isinstance(rule, Excitation):
        pos = flat_x[:, None, :] * wp[None]
        out = spread(pos, pos.sum(2))
    else:  # pragma: no cover
        raise AssertionError(rule)
    return out.reshape(x.shape)


LAYERS = [
    ("linear", lambda b: nn.Linear(7, 5, bias=b), (7,)),
    ("conv1d", lambda b: nn.Conv1d(2, 3, 3, bias=b), (2, 9)),
    ("conv2d", lambda b: nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=b), (2, 6, 5)),
    ("conv2d_groups", lambda b: nn.Conv2d(4, 4, 2, dilation=2, groups=2, bias=b), (4, 5, 5)),
    ("conv3d", lambda b: nn.Conv3d(1, 2, 2, padding=1, bias=b), (1, 3, 4, 3)),
]

RULES = [
    Zero(),
    Epsilon(0.1),
    Gamma(0.25),
    ZPlus(),
    AlphaBeta(2.0, 1.0),
    AlphaBeta(5.0, 4.0),
    Excitation(),
    ContrastiveExcitation(),
]
INPUT_RULES = [WSquare(), Flat(), ZBox(-5.0, 5.0)]


def engine_relevance(model, rule, x, relevance_out, *, first=False):
    composite = LayerComposite([], first=rule) if first else LayerComposite([(nn.Module, rule)])
    forward = ModifiedBackprop(composite).forward(model, x)
    (name,) = forward.layers
    result = forward.backward(start=name, relevance=relevance_out)
    return result.input_signal if result.input_is_relevance else x * result.input_signal


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name, make, shape", LAYERS, ids=[entry[0] for entry in LAYERS])
def test_rules_match_matrix_reference(seed, bias, name, make, shape):
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
    for rule in (Epsilon(0.01), ZPlus(), AlphaBeta(2.0, 1.0), Gamma(0.5)):
        got = engine_relevance(pair, rule, x, relevance_out)
        torch.testing.assert_close(got, reference(rule, pair, x, relevance_out), msg=repr(rule))


@pytest.mark.parametrize("rule", [Epsilon(0.1), ZPlus(), AlphaBeta(2.0, 1.0)], ids=repr)
def test_rules_work_with_the_core_composite_interface(rule):
    """The same rule objects run through explain_core.Composite.context (signal convention)."""
    layer = nn.Conv2d(2, 3, 3, padding=1).double().eval()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    relevance_out = torch.randn_like(layer(x))
    xg = x.clone().requires_grad_(True)
    with Composite([(nn.Conv2d, rule)]).context(layer):
        out = layer(xg)
        (signal,) = torch.autograd.grad(out, xg, relevance_out / out.detach())
    torch.testing.assert_close(x * signal, reference(rule, layer, x, relevance_out))


@pytest.mark.parametrize(
    "rule", [Zero(), ZPlus(), AlphaBeta(2.0, 1.0), Excitation(), WSquare(), Flat()], ids=repr
)
def test_conserving_rules_conserve_on_one_layer(rule):
    layer = nn.Conv2d(3, 4, 3, padding=1, bias=False).double().eval()
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    relevance_out = torch.rand_like(layer(x))
    got = engine_relevance(layer, rule, x, relevance_out, first=rule.relevance_output)
    torch.testing.assert_close(got.sum((1, 2, 3)), relevance_out.sum((1, 2, 3)))


def test_alpha_beta_requires_alpha_minus_beta_one():
    with pytest.raises(ValueError, match="alpha - beta must be 1"):
        AlphaBeta(2.0, 2.0)
    with pytest.raises(ValueError, match="epsilon"):
        Epsilon(-1.0)
