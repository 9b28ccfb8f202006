"""DAU layers against an independent reference written from Algorithm 1 of the CoDA supplement.

The reference modules below use only torch and the paper: unfold the patches, view the raw
weights as ``(batch, patch_dim, out, h, w)``, scale them over ``patch_dim`` with the eps-in-sqrt
non-linearities and sum ``patches * weights``. They take the layers' state dicts through the
reference parameter names (Algorithm 1's; checkpoints of the original code, named otherwise,
are tested in test_coda_checkpoints.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from explain_coda.layers import DAUConv2d, DAULinear
from explain_coda.nonlinearity import EPS
from explain_core import explanation_mode

REFERENCE_EPS = 1e-12  # written out: the convention is part of what is tested
FORMS = ("auto", "factorised", "direct")
NONLINEARITIES = ("l2", "squash")
# float32: each entry is a sum of O(patch_dim) products, so rounding relative to the tensor's
# largest entry stays ~1e-6; 1e-5 of that scale is the tolerance, elementwise and in norm.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The shapes here are tiny: a second thread only adds synchronisation (60× slower on a busy
    2-core machine), so run this module single-threaded and restore the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def scale(q: torch.Tensor, nonlinearity: str) -> torch.Tensor:
    """``L2``: ``1/‖u‖``; ``SQ``: ``‖u‖/(1 + ‖u‖²)``; the norm is ``sqrt(q + eps)``."""
    norm = torch.sqrt(q + REFERENCE_EPS)
    return 1 / norm if nonlinearity == "l2" else norm / (1 + q)


class ReferenceDAUConv2d(nn.Module):
    """Algorithm 1 of the supplement, line by line."""

    def __init__(self, layer: DAUConv2d) -> None:
        super().__init__()
        c_in, c_out, rank, k = layer.in_channels, layer.out_channels, layer.rank, layer.kernel_size
        self.out_channels, self.kernel_size, self.nonlinearity = c_out, k, layer.nonlinearity
        self.stride, self.padding = layer.stride, layer.padding
        self.patch_dim = c_in * k * k
        self.dim_reduction = nn.Conv2d(c_in, rank, k, layer.stride, layer.padding, bias=False)
        self.weightings = nn.Conv2d(rank, c_out * self.patch_dim, kernel_size=1, bias=True)
        self.to(next(layer.parameters()).dtype)
        self.load_state_dict(layer.state_dict(), strict=True)

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        reduced = self.dim_reduction(x)
        h, w = reduced.shape[-2:]
        weights = self.weightings(reduced)
        weights = weights.view(x.shape[0], self.patch_dim, self.out_channels, h, w)
        return weights * scale(weights.pow(2).sum(1, keepdim=True), self.nonlinearity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.weights(x)
        h, w = weights.shape[-2:]
        patches = F.unfold(x, self.kernel_size, padding=self.padding, stride=self.stride)
        patches = patches.view(x.shape[0], self.patch_dim, 1, h, w)
        return (patches * weights).sum(1)


class ReferenceDAULinear(nn.Module):
    """``w_j(x) = g(A_j B x + b_j)``, output ``w_j(x)ᵀx``, entry ``p*out + j`` as in the conv."""

    def __init__(self, layer: DAULinear) -> None:
        super().__init__()
        self.d, self.out = layer.in_features, layer.out_features
        self.nonlinearity = layer.nonlinearity
        self.dim_reduction = nn.Linear(layer.in_features, layer.rank, bias=False)
        self.weightings = nn.Linear(layer.rank, layer.out_features * layer.in_features)
        self.to(next(layer.parameters()).dtype)
        self.load_state_dict(layer.state_dict(), strict=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.weightings(self.dim_reduction(x)).view(-1, self.d, self.out)
        weights = weights * scale(weights.pow(2).sum(1, keepdim=True), self.nonlinearity)
        return (x[:, :, None] * weights).sum(1)


def output_and_grads(
    module: nn.Module, x: torch.Tensor, grad: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The output and the gradients of ``⟨grad, output⟩`` w.r.t. the input and all parameters."""
    x = x.detach().requires_grad_(True)
    out = module(x)
    if grad is None:
        grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *module.parameters()], grad)
    return out, list(grads), grad


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Elementwise within ``tol`` of the tensor's scale, and norm-relative within ``tol``."""
    assert torch.isfinite(actual).all()
    magnitude = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * magnitude)
    error = (actual - expected).norm() / expected.norm().clamp_min(1e-300)
    assert error <= tol, f"norm-relative error {error:.3g} > {tol:g}"


def make_layer(
    c_in: int,
    c_out: int,
    rank: int,
    k: int,
    stride: int = 1,
    padding: int | None = None,
    nonlinearity: str = "squash",
    form: str = "auto",
    dtype: torch.dtype = torch.float32,
) -> DAUConv2d:
    layer = DAUConv2d(c_in, c_out, rank, k, stride, padding, nonlinearity, form=form)
    return layer.to(dtype)


# (in, out, rank, kernel, stride, padding, H, W): kernels 1/3/5/7, strides 1/2, odd maps; the
# first and last have rank + 1 ≥ patch_dim (auto → direct), the others are factorised by auto.
CONFIGS = [
    (3, 4, 5, 1, 1, None, 7, 9),
    (3, 5, 4, 3, 1, None, 7, 9),
    (2, 3, 6, 3, 2, None, 11, 5),
    (2, 3, 4, 3, 1, 0, 7, 9),
    (2, 4, 5, 5, 1, None, 11, 5),
    (1, 3, 4, 7, 2, None, 9, 7),
    (4, 6, 40, 3, 2, None, 5, 6),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "in{}-out{}-r{}-k{}-s{}-p{}-{}x{}".format(*c)
)
def test_conv_matches_algorithm_1(config, nonlinearity, form):
    c_in, c_out, rank, k, stride, padding, height, width = config
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(1)
        layer = make_layer(c_in, c_out, rank, k, stride, padding, nonlinearity, form, dtype)
        reference = ReferenceDAUConv2d(layer)
        x = torch.randn(2, c_in, height, width, dtype=dtype)
        expected, expected_grads, grad = output_and_grads(reference, x)
        out, grads, _ = output_and_grads(layer, x, grad)
        assert out.shape == expected.shape == (2, c_out, *expected.shape[-2:])
        assert_close(out, expected, TOLERANCE[dtype])
        for actual, wanted in zip(grads, expected_grads, strict=True):
            assert_close(actual, wanted, TOLERANCE[dtype])


@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
def test_s_coda_shapes_match_algorithm_1_in_float32(nonlinearity):
    """The first S-CoDA layer (factorised by auto) and the last one (direct by auto)."""
    for c_in, c_out, rank, k, size, form in [
        (6, 16, 32, 3, 12, "factorised"),
        (64, 10, 64, 1, 4, "direct"),
    ]:
        layer = make_layer(c_in, c_out, rank, k, nonlinearity=nonlinearity)
        assert layer.effective_form == form
        x = torch.rand(2, c_in, size, size)
        expected, expected_grads, grad = output_and_grads(ReferenceDAUConv2d(layer), x)
        out, grads, _ = output_and_grads(layer, x, grad)
        assert_close(out, expected, 1e-5)
        for actual, wanted in zip(grads, expected_grads, strict=True):
            assert_close(actual, wanted, 1e-5)


def functional(layer: nn.Module):
    names = [name for name, _ in layer.named_parameters()]

    def apply(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, dict(zip(names, params, strict=True)), (x,))

    return apply, [p.detach().clone().requires_grad_(True) for p in layer.parameters()]


@pytest.mark.parametrize("form", ["factorised", "direct"])
@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
def test_gradcheck_float64(nonlinearity, form):
    layer = make_layer(
        2, 3, 2, 3, stride=2, nonlinearity=nonlinearity, form=form, dtype=torch.float64
    )
    apply, params = functional(layer)
    x = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(apply, (x, *params))
    # Second derivatives in the input and B are exact too (the norm's basis depends on A, b only).
    weightings = [p.detach() for p in params[1:]]
    assert torch.autograd.gradgradcheck(lambda x, b: apply(x, b, *weightings), (x, params[0]))


@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
def test_input_gradient_is_differentiable_in_all_parameters(nonlinearity):
    """d/dθ of a vector-Jacobian product w.r.t. the input (e.g. a regulariser on W_{0→L})."""
    torch.manual_seed(2)
    layer = make_layer(3, 4, 3, 3, nonlinearity=nonlinearity, dtype=torch.float64)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    results = []
    for form in ("factorised", "direct"):
        layer.form = form
        xr = x.clone().requires_grad_(True)
        out = layer(xr)
        (grad_x,) = torch.autograd.grad(out, xr, torch.ones_like(out), create_graph=True)
        results.append(torch.autograd.grad(grad_x.abs().sum(), list(layer.parameters())))
    for factorised, direct in zip(*results, strict=True):
        assert_close(factorised, direct, 1e-10)


@pytest.mark.parametrize("form", ["factorised", "direct"])
@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
def test_zero_weights_stay_finite(nonlinearity, form):
    layer = make_layer(3, 4, 5, 3, nonlinearity=nonlinearity, form=form)
    with torch.no_grad():
        layer.weightings.weight.zero_()
        layer.weightings.bias.zero_()
    out, grads, _ = output_and_grads(layer, torch.randn(2, 3, 5, 7))
    assert torch.equal(out, torch.zeros_like(out))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
def test_rank_deficient_weightings_match_algorithm_1(nonlinearity):
    """A = 0 with b ≠ 0: every A'_j = [A_j, b_j] has rank 1; gradients must still be exact."""
    for dtype in (torch.float32, torch.float64):
        layer = make_layer(3, 4, 5, 3, nonlinearity=nonlinearity, form="factorised", dtype=dtype)
        with torch.no_grad():
            layer.weightings.weight.zero_()
            layer.weightings.weight[:5].normal_()  # a few non-zero rows, rank ≤ 2 per DAU
        x = torch.randn(2, 3, 5, 6, dtype=dtype)
        expected, expected_grads, grad = output_and_grads(ReferenceDAUConv2d(layer), x)
        out, grads, _ = output_and_grads(layer, x, grad)
        assert_close(out, expected, TOLERANCE[dtype])
        for actual, wanted in zip(grads, expected_grads, strict=True):
            assert_close(actual, wanted, TOLERANCE[dtype])


def adversarial_layer(nonlinearity: str, delta: float) -> tuple[DAUConv2d, torch.Tensor]:
    """A layer with ``b_j = −A_j z0 + δ_j`` for the constant input whose patches give ``z0``.

    With ``padding=0`` every patch of a constant input is the same ``p0``, so ``z = B p0 = z0``
    everywhere and ``w_j = A_j z0 + b_j = δ_j`` (plus the float32 rounding of ``b``), while
    ``‖A_j z0‖`` is O(1): the Gram form's ``zᵀGz + 2cᵀz + ‖b‖²`` cancels to ``‖δ‖²``.
    """
    torch.manual_seed(3)
    layer = make_layer(4, 5, 6, 3, padding=0, nonlinearity=nonlinearity)
    x = torch.full((1, 4, 6, 6), 0.7)
    with torch.no_grad():
        layer.weightings.weight.mul_(3.0)
        z0 = layer.dim_reduction.double()(x.double())[0, :, 0, 0]  # exact for fp32 parameters
        layer.dim_reduction.float()
        a = layer.weightings.weight.double().view(layer.patch_dim * 5, 6)
        b = -(a @ z0) + delta * torch.randn(layer.patch_dim * 5, dtype=torch.float64)
        layer.weightings.bias.copy_(b)
    return layer, x


@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
def test_cancelling_weights_stay_accurate_in_float32(nonlinearity):
    layer, x = adversarial_layer(nonlinearity, delta=1e-4)
    truth_layer = ReferenceDAUConv2d(layer).double()  # the same fp32 parameters, exactly
    with torch.no_grad():
        truth = truth_layer(x.double())
        raw = truth_layer.weightings(truth_layer.dim_reduction(x.double()))
        q_truth = raw.view(1, layer.patch_dim, 5, 4, 4).pow(2).sum(1).permute(0, 2, 3, 1)
        reference = ReferenceDAUConv2d(layer)(x)
        ours = {}
        for form in ("factorised", "direct"):
            layer.form = form
            ours[form] = layer(x)
        layer.form = "factorised"
        _, q = layer._numerator_and_squared_norm(x)
        # The Gram form on the same float32 numbers, for contrast.
        z = torch.cat([layer.dim_reduction(x)[0, :, 0, 0], torch.ones(1)])
        weight = layer.weightings.weight.view(layer.patch_dim, 5, 6)
        a = torch.cat([weight, layer.weightings.bias.view(layer.patch_dim, 5, 1)], 2)
        gram = torch.einsum("pjr,pjs->jrs", a, a)  # G_j = A'_jᵀA'_j, then z'ᵀG_j z'
        gram_q = torch.einsum("r,jrs,s->j", z, gram, z)

    def error(value: torch.Tensor) -> float:
        return ((value.double() - truth).norm() / truth.norm()).item()

    q_rel = ((q.double() - q_truth).abs() / q_truth).max().item()
    gram_rel = ((gram_q.double() - q_truth[0, 0, 0]).abs() / q_truth[0, 0, 0]).max().item()
    assert q_truth.max() < 1e-6 * (a.double() ** 2).sum((0, 2)).min()  # really cancelling
    assert (q > 0).all() and q_rel < 1e-2
    assert gram_rel > 100 * q_rel  # what the safe form avoids (the Gram q may even be ≤ 0)
    reference_error = error(reference)
    assert reference_error < 1e-2  # float32 Algorithm 1 itself loses ~3 digits here
    for value in ours.values():
        assert torch.isfinite(value).all()
        assert error(value) <= 10 * reference_error


@pytest.mark.parametrize("form", ["factorised", "direct"])
@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
def test_explanation_mode_gradient_is_the_dynamic_weight(nonlinearity, form):
    """Input×Gradient through one layer in explanation mode = contributions of ``W(x)``."""
    torch.manual_seed(4)
    layer = make_layer(
        3, 4, 5, 3, stride=2, nonlinearity=nonlinearity, form=form, dtype=torch.float64
    )
    x = torch.randn(2, 3, 9, 7, dtype=torch.float64, requires_grad=True)
    with explanation_mode(layer):
        out = layer(x)
        select = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, x, select)
        weights = layer.dynamic_weight(x).detach()  # (B, out, patch_dim, h, w)
    batch, _, patch_dim, h, w = weights.shape
    expected = F.fold(
        (weights * select[:, :, None]).sum(1).view(batch, patch_dim, h * w),
        x.shape[-2:],
        layer.kernel_size,
        padding=layer.padding,
        stride=layer.stride,
    )
    assert_close(grad, expected, 1e-12)
    # Completeness: the contributions sum to the selected output.
    torch.testing.assert_close((grad * x).sum(), (select * out).sum(), rtol=1e-12, atol=1e-12)
    # Outside explanation mode the gradient also flows through W(x), so it differs.
    (plain,) = torch.autograd.grad(layer(x), x, select)
    assert not torch.allclose(plain, grad, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_dynamic_weight_reproduces_forward(form):
    layer = make_layer(3, 4, 5, 5, stride=2, form=form, dtype=torch.float64)
    x = torch.randn(2, 3, 11, 5, dtype=torch.float64)
    weights = layer.dynamic_weight(x)
    batch, _, patch_dim, h, w = weights.shape
    patches = F.unfold(x, 5, padding=layer.padding, stride=2).view(batch, 1, patch_dim, h, w)
    assert_close(layer(x), (weights * patches).sum(2), 1e-12)
    assert_close(weights.transpose(1, 2), ReferenceDAUConv2d(layer).weights(x), 1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_position_major_weight_is_the_dynamic_weight_per_position(bias):
    layer = make_layer(3, 4, 5, 3, stride=2, dtype=torch.float64)
    reference = ReferenceDAUConv2d(layer)
    if not bias:
        layer.weightings.bias = reference.weightings.bias = None
    x = torch.randn(2, 3, 9, 7, dtype=torch.float64)
    expected = reference.weights(x)  # (B, patch_dim, out, h, w)
    assert_close(layer.position_major_weight(x), expected.permute(0, 3, 4, 1, 2), 1e-12)


def test_non_contiguous_inputs_give_the_same_output():
    layer = make_layer(3, 4, 5, 3, form="factorised", dtype=torch.float64)
    x = torch.randn(2, 3, 7, 9, dtype=torch.float64)
    expected = layer(x)
    assert_close(layer(x.contiguous(memory_format=torch.channels_last)), expected, 1e-14)
    assert_close(layer(x.transpose(2, 3).contiguous().transpose(2, 3)), expected, 1e-14)
    assert expected.is_contiguous()


@pytest.mark.parametrize("nonlinearity", NONLINEARITIES)
def test_linear_matches_reference(nonlinearity):
    for dtype in (torch.float32, torch.float64):
        layer = DAULinear(7, 4, 3, nonlinearity).to(dtype)
        x = torch.randn(5, 7, dtype=dtype)
        expected, expected_grads, grad = output_and_grads(ReferenceDAULinear(layer), x)
        out, grads, _ = output_and_grads(layer, x, grad)
        assert_close(out, expected, TOLERANCE[dtype])
        for actual, wanted in zip(grads, expected_grads, strict=True):
            assert_close(actual, wanted, TOLERANCE[dtype])
        weights = layer.dynamic_weight(x)
        assert_close(out, torch.einsum("boi,bi->bo", weights, x), TOLERANCE[dtype])


def test_linear_zero_weights_and_explanation_mode():
    layer = DAULinear(6, 3, 2, "l2").double()
    with torch.no_grad():
        layer.weightings.weight.zero_()
        layer.weightings.bias.zero_()
    _, grads, _ = output_and_grads(layer, torch.randn(4, 6, dtype=torch.float64))
    assert all(torch.isfinite(g).all() for g in grads)
    layer = DAULinear(6, 3, 2, "squash").double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with explanation_mode(layer):
        (grad,) = torch.autograd.grad(layer(x)[:, 1].sum(), x)
    assert_close(grad, layer.dynamic_weight(x)[:, 1].detach(), 1e-14)


def test_parameters_have_algorithm_1_names_and_shapes():
    layer = DAUConv2d(6, 16, 32, 3)
    shapes = {name: tuple(t.shape) for name, t in layer.state_dict().items()}
    assert shapes == {
        "dim_reduction.weight": (32, 6, 3, 3),
        "weightings.weight": (16 * 54, 32, 1, 1),
        "weightings.bias": (16 * 54,),
    }
    assert (layer.in_channels, layer.out_channels, layer.rank) == (6, 16, 32)
    assert (layer.kernel_size, layer.stride, layer.padding, layer.patch_dim) == (3, 1, 1, 54)
    assert layer.nonlinearity == "squash" and layer.form == "auto"
    assert layer.effective_form == "factorised"
    assert DAUConv2d(64, 10, 64, 1).effective_form == "direct"
    assert DAUConv2d(3, 4, 5, 7, stride=2).padding == 3
    assert "form='auto'" in repr(layer)
    assert EPS == REFERENCE_EPS


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"in_channels": 0}, "in_channels must be a positive int"),
        ({"out_channels": -1}, "out_channels must be a positive int"),
        ({"rank": 0}, "rank must be a positive int"),
        ({"kernel_size": 2.5}, "kernel_size must be a positive int"),
        ({"stride": 0}, "stride must be a positive int"),
        ({"padding": -1}, "padding must be a non-negative int"),
        ({"nonlinearity": "relu"}, "nonlinearity must be one of l2, squash; got 'relu'"),
        ({"form": "fast"}, "form must be one of auto, factorised, direct; got 'fast'"),
    ],
)
def test_conv_constructor_validation(kwargs, message):
    args = {"in_channels": 3, "out_channels": 4, "rank": 5, "kernel_size": 3} | kwargs
    with pytest.raises(ValueError, match=message):
        DAUConv2d(**args)


def test_linear_constructor_validation():
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        DAULinear(0, 3, 2)
    with pytest.raises(ValueError, match="rank must be a positive int; got True"):
        DAULinear(4, 3, True)
    with pytest.raises(ValueError, match="nonlinearity must be one of"):
        DAULinear(4, 3, 2, "softmax")


@pytest.mark.parametrize("form", FORMS)
def test_wrong_input_shapes_name_the_expected_shape(form):
    layer = DAUConv2d(3, 4, 5, 3, form=form)
    expected = r"DAUConv2d expects inputs of shape \(batch, 3, H, W\); got "
    with pytest.raises(ValueError, match=expected + r"\(2, 4, 5, 5\)"):
        layer(torch.randn(2, 4, 5, 5))
    with pytest.raises(ValueError, match=expected + r"\(3, 5, 5\)"):
        layer(torch.randn(3, 5, 5))
    with pytest.raises(ValueError, match=expected + r"\(2, 4, 5, 5\)"):
        layer.dynamic_weight(torch.randn(2, 4, 5, 5))
    with pytest.raises(ValueError, match=r"expects inputs of shape \(batch, 6\); got \(2, 5\)"):
        DAULinear(6, 3, 2)(torch.randn(2, 5))


def test_graph_export_uses_algorithm_1():
    """ONNX has no QR: under torch.export, form="auto" takes the direct form, same values."""
    layer = DAUConv2d(3, 4, 5, 3).eval()
    assert layer.effective_form == "factorised"
    x = torch.randn(1, 3, 6, 5)
    exported = torch.export.export(layer, (x,))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not any("linalg_qr" in target for target in targets)
    assert any("im2col" in target for target in targets)  # F.unfold: Algorithm 1
    assert_close(exported.module()(x), layer(x), 1e-5)
