"""Traced gradient graphs: replicate padding's backward, tensors created inside ``forward``, and
max pooling written without onnxruntime's slow indices output.

The first two used to fail every explained export (LRP composites and Input×Gradient): replicate
padding's backward operator has no ONNX translation, and the traced graph's tensor constants were
lost when torch.export rebuilt the module. Each export is compared with ``explain()`` on a
held-back batch; the max-pooling decompositions also against PyTorch's own kernels, ties included.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.backends.opt_einsum
import torch.nn.functional as F
from torch import nn

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason="the onnx extra is not installed")

import onnx  # noqa: E402

from explain_core import explain  # noqa: E402
from explain_onnx import OnnxSession, export_onnx  # noqa: E402
from explain_onnx.gradtrace import (  # noqa: E402
    _adaptive_avg_pool2d_backward,
    _decompositions,
    _max_pool2d_with_indices,
    _max_pool2d_with_indices_backward,
    _nan_to_num,
    _nan_to_num_,
    _replication_pad_backward,
    _threshold_backward,
    _transposed_convolution,
)
from explain_onnx.parity import relative_difference  # noqa: E402
from explain_onnx.windows import window_elements  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

METHODS = ("lrp.epsilon_plus", "input_x_gradient")
STANDARD_DOMAINS = {"", "ai.onnx"}


def assert_matches_explain(path, model: nn.Module, held_back: torch.Tensor, method: str) -> None:
    """The exported graph's logits and map on ``held_back`` against ``explain()``."""
    logits, explanation = OnnxSession(path).run(held_back)
    reference = explain(model, held_back, method)
    assert np.abs(logits - reference.output.numpy()).max() <= 1e-4
    assert explanation.shape == tuple(held_back.shape)
    assert relative_difference(explanation, reference.attribution.numpy()) <= 1e-3
    domains = {node.domain for node in onnx.load(str(path)).graph.node}
    assert domains <= STANDARD_DOMAINS, domains


# --- replicate padding ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, padding",
    [
        ((2, 3, 5, 6), (1, 1, 1, 1)),
        ((2, 3, 5, 6), (0, 2, 3, 1)),  # asymmetric, one side unpadded
        ((2, 3, 5, 6), (-1, 2, 1, -2)),  # negative padding crops
        ((3, 5, 6), (2, 0, 1, 3)),  # unbatched
        ((2, 3, 7), (3, 1)),  # 1d
        ((2, 1, 3, 4, 5), (1, 2, 0, 1, 2, 1)),  # 3d
        ((1, 1, 1, 4), (2, 2, 3, 3)),  # a one-row input, replicated many times
    ],
)
def test_replication_pad_backward_is_autograds(shape, padding):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    padded = F.pad(x, padding, mode="replicate")
    grad = torch.randn_like(padded)
    (expected,) = torch.autograd.grad(padded, x, grad)
    actual = _replication_pad_backward(grad, x.detach(), padding)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


class FunctionalReplicatePad(nn.Module):
    """``F.pad(mode="replicate")`` in ``forward``, asymmetric, before a convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 9 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(x, (0, 2, 1, 2), mode="replicate")
        return self.fc(torch.relu(self.conv(h)).flatten(1))


def replicate_padded(kind: str) -> tuple[nn.Module, tuple[int, ...]]:
    """A small net with replicate padding of ``kind`` and the shape of one input sample."""
    torch.manual_seed(1)
    if kind == "1d":
        layers = [nn.ReplicationPad1d((2, 1)), nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(),
                  nn.Linear(4 * 9, 3)]  # fmt: skip
        return nn.Sequential(*layers).eval(), (2, 8)
    if kind == "2d":  # the audit's model
        layers = [nn.ReplicationPad2d(1), nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(),
                  nn.Linear(4 * 64, 3)]  # fmt: skip
        return nn.Sequential(*layers).eval(), (1, 8, 8)
    if kind == "3d":
        layers = [nn.ReplicationPad3d(1), nn.Conv3d(1, 2, 3), nn.ReLU(), nn.Flatten(),
                  nn.Linear(2 * 4 * 4 * 4, 3)]  # fmt: skip
        return nn.Sequential(*layers).eval(), (1, 4, 4, 4)
    return FunctionalReplicatePad().eval(), (1, 8, 8)


@pytest.mark.parametrize(
    "kind, method",
    [*itertools.product(["1d", "2d", "3d", "F.pad"], METHODS), ("2d", "lrp.z")],
)
def test_replicate_padding_exports_with_parity(tmp_path, kind, method):
    model, sample = replicate_padded(kind)
    torch.manual_seed(2)
    path = tmp_path / "replicate.onnx"
    result = export_onnx(model, torch.randn(4, *sample), path, explain=method)
    assert result.parity is not None and result.parity.passed
    assert_matches_explain(path, model, torch.randn(5, *sample), method)


# --- tensors created inside forward ---------------------------------------------------------


class ForwardConstant(nn.Module):
    """A CNN that makes a tensor in ``forward``: a scalar to add, or a channel mask."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.kind = kind
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        if self.kind == "scalar":
            h = h + torch.tensor(0.5)
        else:
            m = torch.ones(1, 4, 1, 1)
            m[:, 0] = 0
            h = h * m
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["scalar", "mask"])
def test_tensor_constants_of_forward_are_exported(tmp_path, kind, method):
    model = ForwardConstant(kind).eval()
    torch.manual_seed(4)
    path = tmp_path / "constant.onnx"
    result = export_onnx(model, torch.randn(4, 1, 8, 8), path, explain=method)
    assert result.parity is not None and result.parity.passed
    held_back = torch.randn(5, 1, 8, 8)
    assert_matches_explain(path, model, held_back, method)
    # the constant is in the graph: the same weights without it give other logits
    logits, _ = OnnxSession(path).run(held_back)
    with torch.no_grad():
        plain = model.fc(torch.relu(model.conv(held_back)).flatten(1))
    assert np.abs(logits - plain.numpy()).max() > 1e-2


# --- max pooling over tiling windows --------------------------------------------------------


def tied_values(shape: tuple[int, ...], dtype: torch.dtype, nan: bool = False) -> torch.Tensor:
    """Small integers, so most windows hold their maximum more than once (and NaNs if asked)."""
    torch.manual_seed(5)
    x = torch.randint(-1, 2, shape).to(dtype)
    if nan:
        x[0, 0, 0, 1] = x[1, 1, 3, 2] = x[1, 1, 3, 3] = float("nan")
    return x


@pytest.mark.parametrize(
    "shape, kernel, stride, ceil_mode",
    [
        ((2, 3, 8, 8), [2, 2], [2, 2], False),
        ((2, 3, 8, 8), [2, 2], [], False),  # stride left out: the kernel's
        ((2, 3, 9, 7), [2, 2], [2, 2], False),  # a last row and column no window reads
        ((2, 3, 8, 9), [2, 3], [2, 3], False),  # not square
        ((2, 3, 9, 9), [3, 3], [3, 3], True),  # ceil mode where it changes nothing
        ((2, 2, 6, 6), [1, 1], [1, 1], False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_pool_decomposition_is_pytorchs_kernel_with_ties(
    shape, kernel, stride, ceil_mode, dtype
):
    x = tied_values(shape, dtype).requires_grad_(True)
    values, indices = torch.ops.aten.max_pool2d_with_indices(
        x, kernel, stride, [0, 0], [1, 1], ceil_mode
    )
    ours, our_indices = _max_pool2d_with_indices(
        x.detach(), kernel, stride, [0, 0], [1, 1], ceil_mode
    )
    assert torch.equal(ours, values.detach())
    assert torch.equal(our_indices, indices)  # the first maximum of every window, as PyTorch's
    grad = torch.randn_like(values)
    (expected,) = torch.autograd.grad(values, x, grad)
    actual = _max_pool2d_with_indices_backward(
        grad, x.detach(), kernel, stride, [0, 0], [1, 1], ceil_mode, indices
    )
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_window_elements_are_the_strided_slices(size):
    x = torch.randn(2, 3, 3 * size, 2 * size)
    elements = window_elements(x, size)
    assert elements.shape == (2, size * size, 3, 3, 2)
    for a, b in itertools.product(range(size), range(size)):
        assert torch.equal(elements[:, a * size + b], x[..., a::size, b::size])
    elements[0, 0, 0, 0, 0] = 123.0  # a copy, also where the windows are single elements
    assert x[0, 0, 0, 0] != 123.0


def test_max_pool_decomposition_picks_nans_as_pytorch_does():
    x = tied_values((2, 2, 4, 4), torch.float32, nan=True)
    values, indices = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    ours, our_indices = _max_pool2d_with_indices(x, [2, 2], [2, 2])
    torch.testing.assert_close(ours, values, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(our_indices, indices)


@pytest.mark.parametrize(
    "kernel, stride, padding, dilation, ceil_mode",
    [
        ([3, 3], [2, 2], [0, 0], [1, 1], False),  # overlapping windows
        ([2, 2], [2, 2], [1, 1], [1, 1], False),  # padded
        ([2, 2], [2, 2], [0, 0], [2, 2], False),  # dilated
        ([2, 2], [2, 2], [0, 0], [1, 1], True),  # ceil mode adds a partial window
    ],
)
def test_max_pool_decomposition_of_other_windows_adds_shared_maxima_up(
    kernel, stride, padding, dilation, ceil_mode
):
    """The forward stays PyTorch's; the backward is autograd's, ties and shared maxima included."""
    x = tied_values((2, 2, 7, 7), torch.float64).requires_grad_(True)
    args = (kernel, stride, padding, dilation, ceil_mode)
    assert _max_pool2d_with_indices(x.detach(), *args) is NotImplemented
    values, indices = torch.ops.aten.max_pool2d_with_indices(x, *args)
    grad = torch.randn_like(values)
    (expected,) = torch.autograd.grad(values, x, grad)
    actual = _max_pool2d_with_indices_backward(grad, x.detach(), *args, indices)
    torch.testing.assert_close(actual, expected, rtol=1e-15, atol=1e-15)
    if kernel[0] > stride[0]:  # overlapping windows share maxima: the test covers adding up
        planes = indices.flatten(0, 1).flatten(1).tolist()
        assert any(len(set(plane)) < len(plane) for plane in planes)


def test_decompositions_do_not_leave_max_pooling_backward_to_torch():
    """torch 2.11's exporter kept ``max_pool2d_with_indices_backward``: ours decomposes it."""
    table = _decompositions()
    assert table[torch.ops.aten.max_pool2d_with_indices_backward.default] is (
        _max_pool2d_with_indices_backward
    )


class TiedPooling(nn.Module):
    """Convolution, ReLU, max pooling, where the pooled maps are flat on flat image regions."""

    def __init__(self, kernel: tuple[int, int], size: tuple[int, int]) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        nn.init.constant_(self.conv.bias, 0.3)  # flat regions give equal, positive activations
        self.pool = nn.MaxPool2d(kernel)
        pooled = (size[0] // kernel[0]) * (size[1] // kernel[1])
        self.fc = nn.Linear(4 * pooled, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


def flat_regions(batch: int, size: tuple[int, int], seed: int) -> torch.Tensor:
    """Images that are zero but for one bright rectangle: most pooling windows hold ties."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.zeros(batch, 1, *size)
    for image in x:
        top, left = torch.randint(0, size[0] - 3, (2,), generator=generator)
        image[:, top : top + 3, left : left + 3] = torch.rand(3, 3, generator=generator) + 0.5
    return x


@pytest.mark.parametrize("method", [*METHODS, "lrp.zplus"])
@pytest.mark.parametrize("kernel, size", [((2, 2), (8, 8)), ((2, 3), (9, 10))])
def test_tied_max_pooling_exports_with_parity(tmp_path, method, kernel, size):
    model = TiedPooling(kernel, size).eval()
    path = tmp_path / "pooling.onnx"
    result = export_onnx(model, flat_regions(4, size, seed=7), path, explain=method)
    assert result.parity is not None and result.parity.passed
    assert_matches_explain(path, model, flat_regions(5, size, seed=8), method)
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert "MaxPool" not in ops, ops
    # The backward as MaxUnpool, not onnxruntime's slower ScatterElements.
    assert "MaxUnpool" in ops and "ScatterElements" not in ops, ops
    # Square windows: their elements as one SpaceToDepth instead of two Slices each.
    assert ("SpaceToDepth" in ops) == (kernel[0] == kernel[1]), ops


class OverlappingPooling(nn.Module):
    """ResNet's stem pooling (3×3 windows, stride 2, padding 1) after a convolution and ReLU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        nn.init.constant_(self.conv.bias, 0.3)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


def test_overlapping_max_pooling_gradient_exports_with_parity(tmp_path):
    method = "input_x_gradient"
    model = OverlappingPooling().eval()
    path = tmp_path / "pooling.onnx"
    result = export_onnx(model, flat_regions(4, (8, 8), seed=7), path, explain=method)
    assert result.parity is not None and result.parity.passed
    assert_matches_explain(path, model, flat_regions(5, (8, 8), seed=8), method)
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert "ScatterElements" in ops, ops  # shared maxima add up


@pytest.mark.parametrize("opset", [17, 18])
def test_explained_max_pooling_exports_at_older_opsets(tmp_path, opset):
    """The translations write opset-18 operators that onnx converts down (not ReduceProd-18)."""
    model = TiedPooling((2, 2), (8, 8)).eval()
    path = tmp_path / "pooling.onnx"
    result = export_onnx(
        model, flat_regions(4, (8, 8), seed=7), path, explain="lrp.epsilon_plus", opset=opset
    )
    assert result.opset == opset and result.parity is not None and result.parity.passed
    assert_matches_explain(path, model, flat_regions(5, (8, 8), seed=8), "lrp.epsilon_plus")


class Unpooling(nn.Module):
    """A user model that unpools (an encoder-decoder's skip of pooling indices)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2)
        self.fc = nn.Linear(3 * 9 * 7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled, indices = self.pool(self.conv(x))
        return self.fc(self.unpool(pooled, indices, output_size=(9, 7)).flatten(1))


def test_a_user_models_max_unpooling_exports_as_maxunpool(tmp_path):
    model = Unpooling().eval()
    path = tmp_path / "unpooling.onnx"
    result = export_onnx(model, torch.randn(4, 2, 9, 7), path)  # odd sizes: a row/column unread
    assert result.parity is not None and result.parity.passed
    held_back = torch.randn(5, 2, 9, 7)
    (logits,) = OnnxSession(path).run(held_back)
    with torch.no_grad():
        expected = model(held_back).numpy()
    assert np.abs(logits - expected).max() <= 1e-5
    assert "MaxUnpool" in {node.op_type for node in onnx.load(str(path)).graph.node}


def test_input_x_gradient_of_relu_and_pooling_exports_without_where(tmp_path):
    """onnxruntime 1.32 runs ``Where`` ~20× slower than 1.31 on ReLU and pooling masks."""
    model = TiedPooling((2, 2), (8, 8)).eval()
    path = tmp_path / "pooling.onnx"
    export_onnx(model, flat_regions(4, (8, 8), seed=7), path, explain="input_x_gradient")
    assert_matches_explain(path, model, flat_regions(5, (8, 8), seed=8), "input_x_gradient")
    ops = [node.op_type for node in onnx.load(str(path)).graph.node]
    assert "Where" not in ops, ops


# --- ReLU's backward ---------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_threshold_backward_is_pytorchs_for_finite_gradients(threshold, dtype):
    torch.manual_seed(11)
    inputs = torch.randint(-2, 3, (3, 4, 5)).to(dtype) / 2  # exact ties at the threshold
    inputs[0, 0, :2] = torch.tensor([float("nan"), -0.0])
    grad = torch.randn(3, 4, 5, dtype=dtype)
    expected = torch.ops.aten.threshold_backward(grad, inputs, threshold)
    actual = _threshold_backward(grad, inputs, threshold)
    assert torch.equal(actual, expected)  # a NaN input passes the gradient, as PyTorch's does
    assert actual[0, 0, 0] == grad[0, 0, 0]


def test_threshold_backward_is_relus_gradient():
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(64, dtype=torch.float64)
    (expected,) = torch.autograd.grad(torch.relu(x), x, grad)
    actual = _threshold_backward(grad, torch.relu(x).detach(), 0.0)
    assert torch.equal(actual, expected)


# --- transposed convolutions as convolutions ------------------------------------------------


@pytest.mark.parametrize(
    "dims, channels, groups, padding, dilation",
    [
        (2, (16, 32), 1, 1, 1),
        (2, (16, 32), 1, 0, 1),
        (2, (32, 16), 4, 2, 1),  # grouped, padding up to the kernel's reach
        (2, (16, 16), 1, 1, 2),  # dilated
        (1, (16, 24), 2, 1, 1),
        (3, (16, 16), 1, 1, 1),
    ],
)
def test_transposed_convolution_as_convolution_is_pytorchs(
    dims, channels, groups, padding, dilation
):
    torch.manual_seed(9)
    out_channels, in_channels = channels  # of the transposed convolution
    x = torch.randn(2, in_channels, *[7] * dims, dtype=torch.float64)
    weight = torch.randn(in_channels, out_channels // groups, *[3] * dims, dtype=torch.float64)
    bias = torch.randn(out_channels, dtype=torch.float64)
    args = ([1] * dims, [padding] * dims, [dilation] * dims, True, [0] * dims, groups)
    expected = torch.ops.aten.convolution(x, weight, bias, *args)
    actual = _transposed_convolution(x, weight, bias, *args)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "out_channels, stride, padding, output_padding",
    [(3, 1, 1, 0), (16, 2, 1, 1), (16, 1, 3, 0)],  # few channels, strided, padding beyond reach
)
def test_other_transposed_convolutions_stay(out_channels, stride, padding, output_padding):
    x, weight = torch.randn(1, 16, 5, 5), torch.randn(16, out_channels, 3, 3)
    args = ([stride] * 2, [padding] * 2, [1, 1], True, [output_padding] * 2, 1)
    assert _transposed_convolution(x, weight, None, *args) is NotImplemented


def test_explained_graph_leaves_onnxruntime_its_constants(tmp_path):
    """No ``CastLike`` (which onnxruntime cannot fold) and no ``ConvTranspose`` of many channels."""
    torch.manual_seed(10)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 3),
    ).eval()  # fmt: skip
    path = tmp_path / "vgg.onnx"
    export_onnx(model, torch.rand(4, 3, 8, 8), path, explain="lrp.epsilon_plus")
    assert_matches_explain(path, model, torch.rand(5, 3, 8, 8), "lrp.epsilon_plus")
    nodes = onnx.load(str(path)).graph.node
    assert not [node.name for node in nodes if node.op_type == "CastLike"]
    transposed = [node for node in nodes if node.op_type == "ConvTranspose"]
    # Only the input layer's (3 channels; signed form: W⁺ and W⁻ stacked into one product).
    assert len(transposed) == 1


# --- nan_to_num -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, -2.5])
def test_nan_to_num_to_one_number_is_pytorchs(value):
    x = torch.tensor([1.0, -0.0, float("nan"), float("inf"), -float("inf"), 3e38, -1e-45])
    expected = torch.nan_to_num(x, value, value, value)
    assert torch.equal(_nan_to_num(x, value, value, value), expected)
    inplace = x.clone()
    assert _nan_to_num_(inplace, value, value, value) is inplace
    assert torch.equal(inplace, expected)


@pytest.mark.parametrize("values", [(None, None, None), (0.0, 1.0, 0.0), (0.0, 0.0, None)])
def test_nan_to_num_with_several_numbers_stays(values):
    x = torch.tensor([float("nan"), float("inf")])
    assert _nan_to_num(x, *values) is NotImplemented
    assert _nan_to_num_(x, *values) is NotImplemented


# --- adaptive average pooling -------------------------------------------------------------


@pytest.mark.parametrize(
    "size_in, size_out", [((7, 9), (3, 4)), ((8, 8), (3, 3)), ((5, 6), (5, 1))]
)
def test_adaptive_average_pooling_backward_is_autograds(size_in, size_out):
    x = torch.randn(2, 3, *size_in, dtype=torch.float64, requires_grad=True)
    pooled = F.adaptive_avg_pool2d(x, size_out)
    grad = torch.randn_like(pooled)
    (expected,) = torch.autograd.grad(pooled, x, grad)
    actual = _adaptive_avg_pool2d_backward(grad, x.detach())
    assert torch.allclose(actual, expected, rtol=0, atol=1e-12)


def test_adaptive_average_pooling_gradient_keeps_the_batch_dynamic_with_opt_einsum(tmp_path):
    """Where opt_einsum is installed (a dev dependency, as in many user environments), torch
    plans an einsum of three operands from concrete sizes: that fixed the traced batch size and
    the export failed, blaming the model (seen on a GPU machine's environment)."""
    assert torch.backends.opt_einsum.is_available() and torch.backends.opt_einsum.enabled
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(27, 4)
    ).eval()
    path = tmp_path / "adaptive.onnx"
    result = export_onnx(model, torch.rand(4, 1, 8, 8), path, explain="input_x_gradient")
    assert result.parity is not None and result.parity.passed
    for batch in (1, 5):
        assert_matches_explain(path, model, torch.rand(batch, 1, 8, 8), "input_x_gradient")


# --- fake inputs with only the batch axis symbolic ------------------------------------------


def test_only_the_batch_axis_is_symbolic_on_this_torch():
    """The fast path's torch internals import on the torch installed here: a torch that moved
    them would fall back to every size symbolic silently (slower, and nothing would fail)."""
    from explain_onnx.gradtrace import _batch_symbolic

    tensors = {"weight": torch.rand(3, 2)}
    fake_tensors, (x, target) = _batch_symbolic(tensors, [torch.rand(4, 2), torch.zeros(4).long()])
    assert isinstance(x.shape[0], torch.SymInt) and str(x.shape[0]) == str(target.shape[0])
    assert type(x.shape[1]) is int
    assert all(type(size) is int for size in fake_tensors["weight"].shape)


def test_an_explained_export_without_the_fast_path_still_keeps_the_batch_dynamic(
    tmp_path, monkeypatch
):
    """The fallback for a torch without those internals: plain symbolic tracing."""
    import explain_onnx.gradtrace as gradtrace

    def moved(*args, **kwargs):
        raise ImportError("moved")

    monkeypatch.setattr(gradtrace, "_batch_symbolic", moved)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(108, 4)).eval()
    path = tmp_path / "fallback.onnx"
    result = export_onnx(model, torch.rand(4, 1, 8, 8), path, explain="input_x_gradient")
    assert result.parity is not None and result.parity.passed
    assert_matches_explain(path, model, torch.rand(5, 1, 8, 8), "input_x_gradient")
