"""ONNX export of capsule networks: routing unrolled, REM-compacted nets, saliency maps."""

from __future__ import annotations

import pytest
import torch

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason="the onnx extra is not installed")

from explain_capsules import DRCapsNet, MultiLayerCapsNet, capsule_saliency  # noqa: E402
from explain_capsules.compaction import compact, count_parameters  # noqa: E402
from explain_core import explain  # noqa: E402
from explain_onnx import OnnxSession, export_onnx  # noqa: E402
from explain_onnx.parity import relative_difference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dr_capsnet() -> DRCapsNet:
    torch.manual_seed(0)
    model = DRCapsNet(
        image_size=12, conv_channels=8, primary_types=4, primary_dim=4, class_dim=6, classes=5,
        conv_kernel=3, primary_kernel=3, primary_stride=2,
    )  # fmt: skip
    with torch.no_grad():  # larger routing weights: couplings far from uniform
        model.class_capsules.weight.mul_(30)
    return model.eval()


def images(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, 1, 12, 12, generator=torch.Generator().manual_seed(seed))


def test_capsule_saliency_with_levels_and_target(tmp_path):
    from explain_core import quantisation

    quantisation._edges.cache_clear()  # tracing comes first: nothing it makes may be cached
    model = dr_capsnet()
    result = export_onnx(
        model, images(6, 0), tmp_path / "caps.onnx", explain="capsules.saliency",
        target_input=True, levels=11,
    )  # fmt: skip
    assert result.parity.passed
    held_back, target = images(5, 1), torch.tensor([0, 1, 2, 3, 4])
    lengths, maps = OnnxSession(result.path).run(held_back, target)
    ref_maps, ref_lengths, _ = capsule_saliency(model, held_back, target, levels=11)
    assert float((torch.as_tensor(lengths) - ref_lengths).abs().max()) <= 1e-4
    expected = explain(model, held_back, "capsules.saliency", target, levels=11).attribution
    assert maps.shape == tuple(expected.shape) == (5, 1, 12, 12)  # explain()'s shape
    assert relative_difference(maps, expected.numpy()) <= 1e-3
    assert relative_difference(maps.sum(1), ref_maps.numpy()) <= 1e-3  # Eq. 16 per pixel


def test_capsule_saliency_of_predicted_class(tmp_path):
    model = dr_capsnet()
    result = export_onnx(model, images(4, 2), tmp_path / "caps.onnx", explain="capsules.saliency")
    held_back = images(3, 3)
    lengths, maps = OnnxSession(result.path).run(held_back)
    ref_maps, ref_lengths, _ = capsule_saliency(model, held_back)
    assert float((torch.as_tensor(lengths) - ref_lengths).abs().max()) <= 1e-4
    assert relative_difference(maps.sum(1), ref_maps.numpy()) <= 1e-3


def test_compacted_dr_capsnet(tmp_path):
    model = dr_capsnet()
    with torch.no_grad():  # what REM pruning leaves: dead channels and capsule types
        model.conv[0].weight[[1, 3]] = 0
        model.conv[0].bias[[1, 3]] = 0
        d = model.primary.capsule_dim
        model.primary.conv.weight[:d] = 0
        model.primary.conv.bias[:d] = 0
    compacted, _ = compact(model, images(2, 4))
    assert count_parameters(compacted) < count_parameters(model)
    result = export_onnx(compacted.eval(), images(4, 5), tmp_path / "compact.onnx")
    (lengths,) = OnnxSession(result.path).run(images(5, 6))
    with torch.no_grad():
        assert float((torch.as_tensor(lengths) - model(images(5, 6))).abs().max()) <= 1e-4


def test_multi_layer_capsnet(tmp_path):
    torch.manual_seed(0)
    model = MultiLayerCapsNet(in_features=64, hidden_layers=1, iterations=3).eval()
    x = torch.rand(4, 64)
    result = export_onnx(model, x, tmp_path / "ml.onnx")
    assert result.parity.passed
    (lengths,) = OnnxSession(result.path).run(torch.rand(6, 64))
    assert lengths.shape == (6, 10)
