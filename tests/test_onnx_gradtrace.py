"""Traced gradient graphs: replicate padding's backward and tensors created inside ``forward``.

Both used to fail every explained export (LRP composites and Input×Gradient): replicate padding's
backward operator has no ONNX translation, and the traced graph's tensor constants were lost when
torch.export rebuilt the module. Each export is compared with ``explain()`` on a held-back batch.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason="the onnx extra is not installed")

import onnx  # noqa: E402

from explain_core import explain  # noqa: E402
from explain_onnx import OnnxSession, export_onnx  # noqa: E402
from explain_onnx.gradtrace import _replication_pad_backward  # noqa: E402
from explain_onnx.parity import relative_difference  # noqa: E402

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
