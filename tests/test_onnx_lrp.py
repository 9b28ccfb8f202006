"""Explained ONNX export of the LRP composites (ε+z⁺, z⁺, …) for CNNs: parity with ``explain``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason="the onnx extra is not installed")

import onnx  # noqa: E402

from explain_core import explain  # noqa: E402
from explain_core.errors import InvalidInputError  # noqa: E402
from explain_onnx import OnnxSession, available_explainers, export_onnx  # noqa: E402
from explain_onnx.parity import relative_difference  # noqa: E402

STANDARD_DOMAINS = {"", "ai.onnx"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def vgg_bn() -> nn.Module:
    """A small VGG-style CNN: conv-BN-ReLU blocks, max and average pooling, dense head."""
    torch.manual_seed(2)
    layers: list[nn.Module] = []
    channels = 3
    for width in (8, 16):
        layers += [
            nn.Conv2d(channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]
        channels = width
    layers += [
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 2 * 2, 32),
        nn.ReLU(),
        nn.Dropout(),
        nn.Linear(32, 10),
    ]
    model = nn.Sequential(*layers).eval()
    for module in model:
        if isinstance(module, nn.BatchNorm2d):  # trained-looking statistics
            module.running_mean.normal_(0, 0.2)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.normal_(0, 0.1)
    return model


def small_cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 1, stride=2),  # a ResNet's downsampling: its transpose is scattered
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 10),
    ).eval()


def assert_standard_and_valid(path) -> None:
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    domains = {node.domain for node in model.graph.node}
    assert domains <= STANDARD_DOMAINS, domains
    assert not model.functions or {f.domain for f in model.functions} <= STANDARD_DOMAINS


def assert_maps_close(actual: np.ndarray, expected: torch.Tensor) -> None:
    assert relative_difference(actual, expected.numpy()) <= 1e-3


def test_lrp_methods_are_exportable():
    names = set(available_explainers())
    assert {"lrp.epsilon_plus", "lrp.zplus", "lrp.epsilon", "excitation_bp"} <= names
    assert "lrp.zb" not in names and "lrp.contrastive" not in names


def test_vgg_bn_epsilon_plus_with_target_input(tmp_path):
    model = vgg_bn()
    torch.manual_seed(3)
    x = torch.rand(6, 3, 16, 16)
    path = tmp_path / "vgg.onnx"
    result = export_onnx(model, x[:4], path, explain="lrp.epsilon_plus", target_input=True)
    assert result.input_names == ["input", "target"]
    assert result.parity is not None and result.parity.passed
    assert result.parity.explanation_max_rel is not None
    assert_standard_and_valid(path)

    session = OnnxSession(path)
    held_back = torch.rand(5, 3, 16, 16)  # a batch size never traced or checked
    target = torch.tensor([0, 3, 9, 3, 7])
    logits, relevance = session.run(held_back, target)
    reference = explain(model, held_back, "lrp.epsilon_plus", target)
    assert np.abs(logits - reference.output.numpy()).max() <= 1e-4
    assert relevance.shape == (5, 3, 16, 16)
    assert_maps_close(relevance, reference.attribution)
    # the target input matters: another class gives another map
    _, other = session.run(held_back, (target + 1) % 10)
    assert np.abs(other - relevance).max() > 1e-3 * np.abs(relevance).max()


@pytest.mark.parametrize(
    "method, options",
    [("lrp.zplus", {}), ("lrp.alpha_beta", {"bias": True}), ("lrp.gamma", {})],
    ids=["zplus", "alpha_beta_bias", "gamma"],
)
def test_small_cnn_predicted_class_signed_inputs(tmp_path, method, options):
    """Inputs of both signs: the input layer takes the rule's signed form in the graph."""
    model = small_cnn()
    torch.manual_seed(4)
    x = torch.randn(4, 1, 8, 8)
    path = tmp_path / "cnn.onnx"
    result = export_onnx(model, x, path, explain=method, **options)
    assert result.input_names == ["input"] and result.parity is not None and result.parity.passed
    assert_standard_and_valid(path)

    held_back = torch.randn(7, 1, 8, 8)
    logits, relevance = OnnxSession(path).run(held_back)
    reference = explain(model, held_back, method, **options)
    assert np.abs(logits - reference.output.numpy()).max() <= 1e-4
    assert_maps_close(relevance, reference.attribution)
    # and non-negative inputs, where the eager rule takes its other branch
    positive = held_back.abs()
    _, relevance = OnnxSession(path).run(positive)
    assert_maps_close(relevance, explain(model, positive, method, **options).attribution)


def test_method_options_and_refusals(tmp_path):
    model = small_cnn()
    x = torch.rand(3, 1, 8, 8)
    result = export_onnx(model, x, tmp_path / "e.onnx", explain="lrp.epsilon", epsilon=0.25)
    assert result.parity is not None and result.parity.passed
    with pytest.raises(InvalidInputError):
        export_onnx(model, x, tmp_path / "bad.onnx", explain="lrp.epsilon", steps=3)
    with pytest.raises(InvalidInputError, match="cannot be exported"):
        export_onnx(model, x, tmp_path / "zb.onnx", explain="lrp.zb")
    with pytest.raises(InvalidInputError, match=r"'1' \(Softmax\)"):  # the engine's own check
        export_onnx(
            nn.Sequential(nn.Linear(8, 8), nn.Softmax(1), nn.Linear(8, 2)).eval(),
            torch.rand(2, 8),
            tmp_path / "s.onnx",
            explain="lrp.epsilon_plus",
        )
    assert not (tmp_path / "bad.onnx").exists() and not (tmp_path / "s.onnx").exists()


def test_activation_operation_rules_export(tmp_path):
    """LRP's pass rule for a sigmoid (an operation rule) is in the graph, branch-free."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 2)).eval()
    x = torch.randn(4, 8)
    path = tmp_path / "sigmoid.onnx"
    result = export_onnx(model, x, path, explain="lrp.epsilon_plus")
    assert result.parity is not None and result.parity.passed
    held_back = torch.randn(3, 8)
    _, relevance = OnnxSession(path).run(held_back)
    assert_maps_close(relevance, explain(model, held_back, "lrp.epsilon_plus").attribution)


class _ProjectionHead(nn.Module):
    """A CNN whose dense layers are written as products with weights (``F.linear``, ``@``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.hidden = nn.Parameter(torch.randn(6, 4))
        self.projection = nn.Parameter(torch.randn(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).mean((2, 3))
        return torch.relu(F.linear(h, self.hidden)) @ self.projection


@pytest.mark.parametrize("method", ["lrp.gamma", "lrp.epsilon_plus"])
def test_dense_layers_written_as_products_export_branch_free(tmp_path, method):
    # γ's rule looked at the input's sign on such calls (the modules' layers are told the graph
    # cannot), and the export refused the model as "branches on tensor values".
    torch.manual_seed(6)
    model = _ProjectionHead().eval()
    path = tmp_path / "head.onnx"
    result = export_onnx(model, torch.randn(4, 1, 8, 8), path, explain=method)
    assert result.parity is not None and result.parity.passed
    held_back = torch.randn(3, 1, 8, 8)
    _, relevance = OnnxSession(path).run(held_back)
    assert_maps_close(relevance, explain(model, held_back, method).attribution)


def test_custom_composite_with_a_lone_batchnorm_exports(tmp_path):
    """``lrp.custom`` (a composite of one's own) exports; a BatchNorm after a ReLU has its rule."""
    from explain_modbp import Epsilon, composites

    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 16, 3),
    ).eval()  # fmt: skip
    model[2].running_var.uniform_(0.5, 2.0)
    composite = composites.lrp_epsilon_plus().with_rules((nn.BatchNorm2d, Epsilon(0.5)))
    x = torch.rand(3, 1, 8, 8)
    path = tmp_path / "custom.onnx"
    result = export_onnx(model, x, path, explain="lrp.custom", composite=composite)
    assert result.parity is not None and result.parity.passed
    held_back = torch.rand(5, 1, 8, 8)
    _, relevance = OnnxSession(path).run(held_back)
    reference = explain(model, held_back, "lrp.custom", composite=composite).attribution
    assert_maps_close(relevance, reference)
    preset = explain(model, held_back, "lrp.epsilon_plus").attribution  # ε = 1e-6 on the BN
    assert relative_difference(relevance, preset.numpy()) > 1e-3


class _RecurrentClassifier(nn.Module):
    def __init__(self, layer: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = layer(4, 8, batch_first=True, num_layers=2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


@pytest.mark.parametrize("layer", [nn.LSTM, nn.RNN])
def test_a_recurrent_classifier_exports_its_lrp_and_runs_in_a_plain_session(tmp_path, layer):
    import onnxruntime

    model = _RecurrentClassifier(layer).eval()
    x = torch.rand(4, 3, 4, generator=torch.Generator().manual_seed(1))
    result = export_onnx(model, x, tmp_path / "recurrent.onnx", explain="lrp.epsilon_plus")
    assert result.parity.passed
    session = onnxruntime.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    held_back = torch.rand(3, 3, 4, generator=torch.Generator().manual_seed(2))
    logits, maps = session.run(None, {"input": held_back.numpy()})
    expected = explain(model, held_back, "lrp.epsilon_plus")
    np.testing.assert_allclose(logits, expected.output.numpy(), atol=1e-5)
    assert relative_difference(maps, expected.attribution.numpy()) <= 1e-3


class _LearnedInitialState(nn.Module):
    """A 2-layer GRU started from a learned state: its first size, 2, is the example batch's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.GRU(4, 6, num_layers=2, batch_first=True), nn.Linear(6, 3)
        self.h0 = nn.Parameter(0.3 * torch.randn(2, 1, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x, self.h0.expand(-1, x.shape[0], -1))
        return self.head(out[:, -1])


@pytest.mark.parametrize("method", ["input_x_gradient", "lrp.epsilon"])
def test_an_example_batch_as_large_as_another_size_keeps_the_batch_dynamic(tmp_path, method):
    # symbolic tracing gave the batch of 2 and the 2 layers one symbol, which the layer's check
    # of its initial states fixed: refused as a model that fixes the batch size
    model = _LearnedInitialState().eval()
    x = torch.rand(2, 5, 4, generator=torch.Generator().manual_seed(1))
    result = export_onnx(model, x, tmp_path / "h0.onnx", explain=method)
    assert result.parity.passed
    held_back = torch.rand(3, 5, 4, generator=torch.Generator().manual_seed(2))
    _, maps = OnnxSession(result.path).run(held_back)
    expected = explain(model, held_back, method).attribution
    assert relative_difference(maps, expected.numpy()) <= 1e-3
