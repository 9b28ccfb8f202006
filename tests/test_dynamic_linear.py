import pytest
import torch
from torch import nn

from explain_core import DynamicLinear, dynamic_linear_contributions, explain, explanation_mode
from explain_core.errors import InvalidInputError, UnsupportedModelError


class ToyDynamicDense(DynamicLinear):
    """y = W(x) x with W(x) = tanh(A x + a) reshaped to (out, in): a dynamic linear map."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.generator = nn.Linear(d_in, d_out * d_in)

    def dynamic_weight(self, x):
        w = torch.tanh(self.generator(self.weight_input(x)))
        return w.view(-1, self.d_out, self.d_in)

    def forward(self, x):
        return torch.einsum("boi,bi->bo", self.dynamic_weight(x), x)


def toy_model() -> nn.Sequential:
    return nn.Sequential(ToyDynamicDense(6, 5), nn.ReLU(), ToyDynamicDense(5, 3)).double().eval()


def explicit_total_matrix(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """W_{0→L}(x) built by multiplying the explicit per-layer matrices."""
    first, _, second = model
    w1 = first.dynamic_weight(x)  # (B, 5, 6)
    hidden = torch.einsum("boi,bi->bo", w1, x)
    mask = (hidden > 0).double()
    relu_out = hidden * mask
    w2 = second.dynamic_weight(relu_out)  # (B, 3, 5)
    return torch.einsum("boh,bh,bhi->boi", w2, mask, w1)


def test_contributions_equal_explicit_matrix_and_sum_to_output():
    model = toy_model()
    x = torch.randn(4, 6, dtype=torch.float64)
    target = torch.tensor([0, 1, 2, 1])
    result = dynamic_linear_contributions(model, x, target)
    with torch.no_grad():
        total = explicit_total_matrix(model, x)
        output = model(x)
    expected = total[torch.arange(4), target] * x
    torch.testing.assert_close(result.contributions, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        result.contributions.sum(1), output[torch.arange(4), target], rtol=1e-12, atol=1e-12
    )


def test_all_classes_in_one_call_equal_per_class_calls():
    model = toy_model()
    x = torch.randn(3, 6, dtype=torch.float64)
    every = torch.arange(3).expand(3, 3)
    result = dynamic_linear_contributions(model, x, every)
    assert result.contributions.shape == (3, 3, 6)
    for k in range(3):
        single = dynamic_linear_contributions(model, x, torch.full((3,), k))
        torch.testing.assert_close(result.contributions[:, k], single.contributions)


def test_plain_gradient_without_explanation_mode_is_not_exact():
    model = toy_model()
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    output = model(x)
    (grad,) = torch.autograd.grad(output[:, 0].sum(), x)
    assert not torch.allclose((grad * x).sum(1), output[:, 0].detach())


def test_explanation_mode_is_restored_also_after_an_exception():
    model = toy_model()
    layers = [model[0], model[2]]
    with explanation_mode(model):
        assert all(layer.explanation_mode for layer in layers)
    assert not any(layer.explanation_mode for layer in layers)
    assert all("_explanation_mode" not in layer.__dict__ for layer in layers)
    with pytest.raises(RuntimeError), explanation_mode(model):
        raise RuntimeError("boom")
    assert not any(layer.explanation_mode for layer in layers)


def test_registered_method_reports_zero_delta_for_bias_free_model():
    model = toy_model()
    x = torch.randn(5, 6, dtype=torch.float64)
    result = explain(model, x, "dynamic.contributions")
    assert result.delta is not None
    assert result.delta.abs().max() < 1e-12
    torch.testing.assert_close(result.target, model(x).argmax(1))


def test_relu_network_with_bias_reports_the_bias_part_as_delta():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    result = explain(model, x, "dynamic.contributions", target=1)
    with torch.no_grad():
        hidden = model[0](x)
        mask = (hidden > 0).double()
        w = model[2].weight[1] * mask  # (B, 3)
        bias_part = (w * model[0].bias).sum(1) + model[2].bias[1]
    torch.testing.assert_close(result.delta, bias_part)


def test_explicit_weight_default_raises_a_clear_error():
    class NoExplicit(DynamicLinear):
        def forward(self, x):
            return x

    with pytest.raises(NotImplementedError, match="does not materialise"):
        NoExplicit().dynamic_weight(torch.zeros(1, 2))


def test_bad_targets_and_outputs_are_rejected():
    model = toy_model()
    x = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match=r"\[0, 2\]"):
        dynamic_linear_contributions(model, x, torch.tensor([0, 3]))
    with pytest.raises(InvalidInputError, match="floating point"):
        dynamic_linear_contributions(model, x.long(), torch.tensor([0, 1]))
    with pytest.raises(InvalidInputError, match="shape"):
        dynamic_linear_contributions(lambda t: t.sum(), x, torch.tensor([0, 1]))


class PiecewiseLinear(nn.Module):
    """The piecewise-linear kinds the check lets through, bias-free: exact contributions."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(4, affine=False)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x))  # a BatchNorm in eval, without a shift: linear
        h = torch.nn.functional.max_pool2d(h * (h > 0), 2)  # a ReLU written out, max pooling
        h = torch.nn.functional.leaky_relu(h + x.mean(1, keepdim=True)[:, :, ::2, ::2], 0.1)
        rows = torch.stack([row.amax((-1, -2)) for row in h])  # iterating the batch
        return self.head(torch.cat([rows, h.mean((-1, -2))], 1))


def test_a_piecewise_linear_model_passes_the_check_and_its_contributions_sum_to_the_output():
    torch.manual_seed(0)
    model = PiecewiseLinear().double()
    with torch.no_grad():
        model.norm.running_var.uniform_(0.5, 2.0)
    model.eval()
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    result = explain(model, x, "dynamic.contributions", target=2)
    torch.testing.assert_close(result.attribution.sum((1, 2, 3)), model(x)[:, 2])
    leaf = x.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(leaf)[:, 2].sum(), leaf)
    torch.testing.assert_close(result.attribution, gradient * x)  # Input×Gradient, rightly


class Gated(nn.Module):
    """x times a function of itself (a squeeze-excitation gate without the sigmoid)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.mean(1, keepdim=True)


class Reciprocal(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :1] / (1 + x.abs())


class RowsThroughTanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.tanh(row) for row in x])


@pytest.mark.parametrize(
    ("layer", "refused"),
    [
        (nn.Tanh(), "operation 'tanh' in module '1' \\(Tanh\\) is not piecewise linear"),
        (nn.GELU(), "operation 'gelu' in module '1' \\(GELU\\)"),
        (nn.SiLU(), "operation 'silu' in module '1' \\(SiLU\\)"),
        (nn.Hardswish(), "operation 'hardswish' in module '1' \\(Hardswish\\)"),
        (nn.Softmax(1), "operation 'softmax' in module '1' \\(Softmax\\)"),
        (nn.LayerNorm(4), "operation 'layer_norm' in module '1' \\(LayerNorm\\)"),
        (Gated(), "operation 'mul' in module '1' \\(Gated\\) multiplies or divides tensors"),
        (Reciprocal(), "operation 'div' in module '1' \\(Reciprocal\\) multiplies or divides"),
        (RowsThroughTanh(), "operation 'tanh' in module '1' \\(RowsThroughTanh\\)"),
    ],
)
def test_an_operation_that_is_not_dynamic_linear_is_refused_not_taken_as_input_x_gradient(
    layer, refused
):
    # each map was Input×Gradient under the name of exact contributions: not summing to the output
    model = nn.Sequential(nn.Linear(3, 4, bias=False), layer, nn.Linear(4, 2, bias=False))
    model = model.double().eval()
    x = torch.randn(2, 3, dtype=torch.float64)
    for options in ({"method": "dynamic.contributions"}, {"composite": "explanation_mode"}):
        method = options.pop("method", "gradient")
        with pytest.raises(UnsupportedModelError, match=refused + ".*input_x_gradient"):
            explain(model, x, method, 0, **options)
    explain(model, x, "input_x_gradient", 0)  # the map the advice names
