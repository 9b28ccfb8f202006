"""Guided BP, Deconv, RectGrad and DeepLIFT against independent layer-by-layer references."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, state_fingerprint
from modbp_nets import conv_net, randomise_batchnorm, resnet
from torch import nn
from zoo_references import reference_contrastive_lrp

from explain_core import explain
from explain_core.errors import InvalidInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cnn():
    return conv_net((2, 4, 5), 3, (6, 3)).double()


def layerwise_backward(model, x, start, relu_backward):
    """Independent reference: autograd per layer, ReLU backward replaced by ``relu_backward``."""
    activations = [x]
    for layer in model:
        activations.append(layer(activations[-1]).detach())
    g = start
    for index in reversed(range(len(model))):
        layer, h = model[index], activations[index]
        if isinstance(layer, nn.ReLU):
            g = relu_backward(g, activations[index + 1])
        else:
            hg = h.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(layer(hg), hg, g)
    return g


def rectgrad_relu(g, y, q=0.98):
    importance = (y * g).flatten(1)
    threshold = torch.quantile(importance, q, dim=1, keepdim=True)
    return g * ((importance > threshold).reshape(g.shape) & (y > 0))


@pytest.mark.parametrize(
    "method, relu_backward",
    [
        ("guided_bp", lambda g, y: g.clamp(min=0) * (y > 0)),
        ("deconv", lambda g, y: g.clamp(min=0)),
        ("rectgrad", rectgrad_relu),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_rectified_gradients_match_layerwise_reference(method, relu_backward, seed):
    torch.manual_seed(seed)
    model = cnn()
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    result = explain(model, x, method, target=[0, 1, 2])
    start = F.one_hot(torch.tensor([0, 1, 2]), 3).double()
    expected = layerwise_backward(model, x, start, relu_backward)
    torch.testing.assert_close(result.attribution, expected)


def test_guided_bp_is_the_same_for_functional_inplace_and_module_relus():
    class Functional(nn.Module):
        def __init__(self, seq):
            super().__init__()
            self.conv1, self.conv2, self.fc1, self.fc2 = seq[0], seq[3], seq[6], seq[8]

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x), inplace=True), 2)
            x = torch.relu(self.conv2(x)).flatten(1)
            return self.fc2(self.fc1(x).relu_())

    model = cnn()
    functional = Functional(model).eval()
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    for method in ("guided_bp", "deconv", "rectgrad"):
        a = explain(model, x, method, target=1).attribution
        b = explain(functional, x, method, target=1).attribution
        torch.testing.assert_close(a, b)


class CaptumResidual(nn.Module):
    """A residual net Captum can hook: one ReLU module per use, BatchNorm, no functional ReLU."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.relu2 = nn.ReLU()
        self.pool = nn.AvgPool2d(2)
        self.fc1 = nn.Linear(6 * 4 * 4, 10)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(10, 4)

    def forward(self, x):
        h = self.relu1(self.bn1(self.conv1(x)))
        h = self.relu2(self.bn2(self.conv2(h)) + h)
        h = torch.flatten(self.pool(h), 1)
        return self.fc2(self.relu3(self.fc1(h)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deeplift_rescale_equals_captum(seed):
    captum = pytest.importorskip("captum.attr")
    torch.manual_seed(seed)
    model = randomise_batchnorm(CaptumResidual()).double().eval()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    reference = 0.3 * torch.randn(3, 3, 8, 8, dtype=torch.float64)
    ours = explain(model, x, "deeplift.rescale", target=[0, 3, 1], baselines=reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, delta = captum.DeepLift(model).attribute(
            x, reference, target=[0, 3, 1], return_convergence_delta=True
        )
    torch.testing.assert_close(ours.attribution, theirs.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours.delta, -delta.detach(), rtol=0, atol=1e-10)


def test_deeplift_rescale_max_pool_rule_keeps_summation_to_delta():
    model = cnn()
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    for method in ("deeplift.rescale", "deeplift.reveal_cancel"):
        result = explain(model, x, method, target=2, baselines=torch.zeros(1, 2, 6, 6).double())
        torch.testing.assert_close(result.delta, torch.zeros(3).double(), atol=1e-10, rtol=0)
    resnet_model = resnet()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for method in ("deeplift.rescale", "deeplift.reveal_cancel"):
        result = explain(resnet_model, x, method, target=1, baselines=0.1)
        torch.testing.assert_close(result.delta, torch.zeros(2).double(), atol=1e-10, rtol=0)


def reveal_cancel_reference(model, x, x0, target, decoupled):
    """Dense RevealCancel (Eq. 13) on an MLP of Linear/ReLU layers, written out by hand."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    h, h0 = [x], [x0]
    for layer in linears[:-1]:
        h.append(F.relu(layer(h[-1])).detach())
        h0.append(F.relu(layer(h0[-1])).detach())
    m_pos = m_neg = F.one_hot(target, linears[-1].out_features).double()
    for index in reversed(range(len(linears))):
        w = linears[index].weight.detach()
        wp, wn = w.clamp(min=0), w.clamp(max=0)
        delta = h[index] - h0[index]
        mask_p, mask_n = (delta > 0).double(), (delta < 0).double()
        if decoupled:
            m = mask_p * (m_pos @ wp) + mask_n * (m_neg @ wn)
        else:
            m = mask_p * (m_pos @ wp + m_neg @ wn) + mask_n * (m_pos @ wn + m_neg @ wp)
        if index == 0:
            return (x - x0) * m
        # the ReLU below this layer: RevealCancel multipliers of the previous layer's parts
        prev = linears[index - 1]
        d = h[index - 1] - h0[index - 1]
        dp, dn = d * (d > 0), d * (d < 0)
        pw, nw = prev.weight.detach().clamp(min=0), prev.weight.detach().clamp(max=0)
        zp = dp @ pw.T + dn @ nw.T
        zn = dp @ nw.T + dn @ pw.T
        z0 = prev(h0[index - 1]).detach()
        dy_p = 0.5 * (F.relu(z0 + zp) - F.relu(z0)) + 0.5 * (F.relu(z0 + zn + zp) - F.relu(z0 + zn))
        dy_n = 0.5 * (F.relu(z0 + zn) - F.relu(z0)) + 0.5 * (F.relu(z0 + zp + zn) - F.relu(z0 + zp))
        m_pos = m * torch.where(zp.abs() < 1e-10, (z0 + zp + zn > 0).double(), dy_p / zp)
        m_neg = m * torch.where(zn.abs() < 1e-10, (z0 + zp + zn > 0).double(), dy_n / zn)
    raise AssertionError


@pytest.mark.parametrize(
    "method, decoupled", [("deeplift.reveal_cancel", False), ("deeplift.ablation", True)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_reveal_cancel_and_ablation_match_dense_reference(method, decoupled, seed):
    torch.manual_seed(seed)
    model = (
        nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3))
        .double()
        .eval()
    )
    x = torch.randn(4, 5, dtype=torch.float64)
    x0 = 0.5 * torch.randn(4, 5, dtype=torch.float64)
    target = torch.tensor([0, 1, 2, 0])
    result = explain(model, x, method, target=target, baselines=x0)
    expected = reveal_cancel_reference(model, x, x0, target, decoupled)
    torch.testing.assert_close(result.attribution, expected, rtol=1e-9, atol=1e-12)


def test_deeplift_bad_reference_and_state():
    model = resnet()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    before = state_fingerprint(model)
    for method in ("deeplift.rescale", "deeplift.reveal_cancel", "deeplift.ablation"):
        with pytest.raises(InvalidInputError, match="do not broadcast"):
            explain(model, x, method, baselines=torch.zeros(2, 3, 7, 7))
        explain(model, x, method)
        assert_same_state(before, state_fingerprint(model))
    from explain_modbp.deeplift import DeepLiftRescale

    with pytest.raises(InvalidInputError, match="does not fit the inputs"):
        DeepLiftRescale().attribute(model, x, None, torch.zeros(3, 3, 8, 8))
    with pytest.raises(InvalidInputError, match="maxpool"):
        explain(model, x, "deeplift.rescale", maxpool="average")


class _RawInputSkip(nn.Module):
    """``fc(relu(conv(x) + skip(x)))`` and a tanh of the raw input: the input itself, a leaf,
    is an operand of the sum and of an activation."""

    def __init__(self, skip) -> None:
        super().__init__()
        self.skip = skip
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = F.relu(self.conv(x) + self.skip(x)).mean((2, 3))
        return self.fc(torch.cat([h, torch.tanh(x).mean((2, 3))], 1))


@pytest.mark.parametrize("method", ["deeplift.rescale", "deeplift.reveal_cancel"])
def test_deeplift_treats_the_raw_input_as_an_activation(method):
    # The raw input in a sum (a skip from the input) and under an activation gets the rules an
    # activation gets: the map sums to f(x) − f(x0) and equals the same model with the input
    # first passed through an operation (1·x), which made it a non-leaf tensor.
    torch.manual_seed(0)
    model = _RawInputSkip(lambda x: x).double().eval()
    scaled = _RawInputSkip(lambda x: 1 * x).double().eval()
    scaled.load_state_dict(model.state_dict())
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    x0 = 0.2 * torch.rand(2, 3, 6, 6, dtype=torch.float64)
    result = explain(model, x, method, target=1, baselines=x0)
    with torch.no_grad():
        difference = model(x)[:, 1] - model(x0)[:, 1]
    torch.testing.assert_close(result.attribution.sum((1, 2, 3)), difference)
    expected = explain(scaled, x, method, target=1, baselines=x0).attribution
    torch.testing.assert_close(result.attribution, expected, rtol=1e-12, atol=1e-14)


def test_contrastive_lrp_refuses_a_model_with_one_output():
    # Eq. 15's second map was 0 there: the map was z⁺'s, divided by its sum
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1)).eval()
    with pytest.raises(InvalidInputError, match=r"returns 1: there is nothing to contrast"):
        explain(model, torch.randn(3, 6), "lrp.contrastive", 0)
    flat = nn.Sequential(model, nn.Flatten(0))  # shaped (batch,): the shape error, not Python's
    with pytest.raises(InvalidInputError, match=r"must return scores of shape \(batch, n_outputs"):
        explain(flat.eval(), torch.randn(3, 6), "lrp.contrastive", 0)
    # with two outputs it is Eq. 15
    model[2] = nn.Linear(8, 2)
    model = model.double()
    x = torch.randn(3, 6, dtype=torch.float64)
    got = explain(model, x, "lrp.contrastive", 1).attribution
    torch.testing.assert_close(got, reference_contrastive_lrp(model, x, 1))
