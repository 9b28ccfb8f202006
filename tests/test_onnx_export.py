"""ONNX export of CoDA-Nets and CNNs, plain and explained: parity, dynamic batch, full checker."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason="the onnx extra is not installed")

import onnx  # noqa: E402

from explain_coda import CoDANet, coda_contributions, encode_input  # noqa: E402
from explain_core import InvalidInputError, explain  # noqa: E402
from explain_core.data import load_digits  # noqa: E402
from explain_onnx import OnnxSession, export_onnx  # noqa: E402
from explain_onnx.parity import relative_difference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.fixture(scope="module")
def coda(digits):
    torch.manual_seed(0)
    model = CoDANet.from_preset("digits", temperature=8.0).eval()
    x = encode_input(digits.test_images)
    return model, x[:8], x[100:107]  # model, example batch, held-back batch of another size


def small_cnn() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(3),
        nn.Flatten(),
        nn.Linear(72, 10),
    ).eval()
    model[4].running_mean.normal_()
    model[4].running_var.uniform_(0.5, 2.0)
    return model


@pytest.fixture(scope="module")
def cnn(digits):
    return small_cnn(), digits.test_images[:8], digits.test_images[200:205]


def assert_close_logits(actual, expected) -> None:
    assert float((torch.as_tensor(actual) - expected).abs().max()) <= 1e-4


def test_plain_coda_parity_dynamic_batch_and_full_checker(coda, tmp_path):
    model, example, held_back = coda
    before = state_fingerprint(model)
    result = export_onnx(model, example, tmp_path / "coda.onnx")
    assert_same_state(before, state_fingerprint(model))

    report = result.parity
    assert report.passed and report.logits_max_abs <= 1e-4
    assert report.batch_sizes == [1, 3]
    assert {case.source for case in report.cases} == {"random", "real"}
    onnx.checker.check_model(str(result.path), full_check=True)
    graph = onnx.load(str(result.path)).graph
    assert [i.name for i in graph.input] == ["input"]
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"  # named, dynamic
    assert [o.name for o in graph.output] == ["logits"]
    assert graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"

    session = OnnxSession(result.path, device="cpu")
    (logits,) = session.run(held_back)  # 7 samples: neither traced nor parity-checked size
    with torch.no_grad():
        assert_close_logits(logits, model(held_back))
    assert "1e-04" in result.summary() or "0.0001" in result.summary()


def test_explained_coda_matches_coda_contributions(coda, tmp_path):
    model, example, held_back = coda
    result = export_onnx(
        model, example, tmp_path / "coda-explained.onnx", explain="coda.contributions"
    )
    assert result.output_names == ["logits", "explanation"]
    assert result.parity.explanation_max_rel <= 1e-3

    logits, contributions = OnnxSession(result.path).run(held_back)
    reference = coda_contributions(model, held_back)  # the predicted class
    assert_close_logits(logits, reference.output)
    assert contributions.shape == tuple(held_back.shape)
    assert relative_difference(contributions, reference.contributions.numpy()) <= 1e-3
    # Completeness holds in the graph too: contributions sum to the logit minus b₀.
    chosen = logits.argmax(1)
    total = contributions.reshape(len(held_back), -1).sum(1)
    expected = logits[range(len(chosen)), chosen] - model.logit_bias
    assert abs(total - expected).max() <= 1e-4


def test_explained_coda_with_target_input(coda, tmp_path):
    model, example, held_back = coda
    result = export_onnx(
        model, example, tmp_path / "coda-target.onnx", explain="coda.contributions",
        target_input=True,
    )  # fmt: skip
    assert result.input_names == ["input", "target"]
    target = torch.tensor([0, 1, 2, 3, 4, 5, 9])
    logits, contributions = OnnxSession(result.path).run(held_back, target)
    reference = coda_contributions(model, held_back, target)
    assert_close_logits(logits, reference.output)
    assert relative_difference(contributions, reference.contributions.numpy()) <= 1e-3


@pytest.mark.parametrize("method", ["input_x_gradient", "lrp.epsilon_plus"])
def test_invalid_targets_give_nan_maps_and_the_session_refuses_them(cnn, tmp_path, method):
    import onnxruntime

    model, example, held_back = cnn
    result = export_onnx(model, example, tmp_path / "t.onnx", explain=method, target_input=True)
    graph = onnx.load(str(result.path)).graph
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*graph.input, *graph.output]}  # fmt: skip
    assert shapes == {
        "input": ["batch", 1, 8, 8], "target": ["batch"],
        "logits": ["batch", 10], "explanation": ["batch", 1, 8, 8],
    }  # fmt: skip
    target = torch.tensor([3, -1, 10, 9, 0])
    # The graph alone (any onnxruntime user): rows of invalid targets are NaN, the others exact.
    raw = onnxruntime.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    logits, maps = raw.run(None, {"input": held_back.numpy(), "target": target.numpy()})
    assert torch.isnan(torch.as_tensor(maps[[1, 2]])).all()
    valid = [0, 3, 4]
    reference = explain(model, held_back[valid], method, target[valid])
    assert relative_difference(maps[valid], reference.attribution.numpy()) <= 1e-3
    with torch.no_grad():
        assert_close_logits(logits, model(held_back))
    # The runtime wrapper refuses them before running, naming the samples.
    session = OnnxSession(result.path)
    with pytest.raises(InvalidInputError, match=r"in \[0, 9\].*sample 1: -1, sample 2: 10"):
        session.run(held_back, target)
    with pytest.raises(InvalidInputError, match="integer class indices"):
        session.run(held_back, target.float())
    # onnxruntime's own errors named a node (or a type mismatch): the wrapper names the input
    valid_target = torch.tensor([3, 1, 0, 9, 2])
    expected = session.run(held_back, valid_target)
    widened = session.run(held_back, valid_target.int())  # int32 class indices: widened
    np.testing.assert_array_equal(widened[1], expected[1])
    with pytest.raises(InvalidInputError, match=r"one target per sample; got input: 5 rows"):
        session.run(held_back, valid_target[:4])
    with pytest.raises(InvalidInputError, match=r"'input' must be float32.*got float64"):
        session.run(held_back.double(), valid_target)
    with pytest.raises(InvalidInputError, match=r"shape \(batch, 1, 8, 8\), as exported"):
        session.run(torch.zeros(5, 1, 9, 9), valid_target)


def test_plain_cnn_with_opset(cnn, tmp_path):
    model, example, held_back = cnn
    result = export_onnx(model, example, tmp_path / "cnn.onnx", opset=18)
    assert result.opset == 18
    (logits,) = OnnxSession(result.path).run(held_back)
    with torch.no_grad():
        assert_close_logits(logits, model(held_back))


def test_cnn_input_x_gradient(cnn, tmp_path):
    model, example, held_back = cnn
    before = state_fingerprint(model)
    result = export_onnx(model, example, tmp_path / "cnn-ixg.onnx", explain="input_x_gradient")
    assert_same_state(before, state_fingerprint(model))
    assert result.parity.passed
    ops = {node.op_type for node in onnx.load(str(result.path)).graph.node}
    assert "ConvTranspose" in ops  # the convolutions' backward pass, written as forward ops

    logits, maps = OnnxSession(result.path).run(held_back)
    reference = explain(model, held_back, "input_x_gradient")
    assert_close_logits(logits, reference.output)
    assert relative_difference(maps, reference.attribution.numpy()) <= 1e-3


def test_a_plugins_export_form_is_exported(cnn, tmp_path, monkeypatch):
    # The extension point every plugin uses (the built-in forms too): a build and a reference,
    # returned from the explain_register_export_forms hook.
    import explain_core.plugin_manager as plugin_manager
    from explain_core import hookimpl
    from explain_core.export_forms import ExportForm
    from explain_onnx import available_explainers
    from explain_onnx.gradtrace import input_gradient_graph

    def build(model, example, target_input, **options):
        return input_gradient_graph(model, example, target_input=target_input,
                                    multiply_by_input=False)  # fmt: skip

    def reference(model, x, target, **options):
        result = explain(model, x, "gradient", target)
        return result.output, result.attribution

    class GradientForm:
        @hookimpl
        def explain_register_export_forms(self):
            return [ExportForm("gradient", build, reference, "plain gradient")]

    manager = plugin_manager.PluginManager()
    manager.load(entry_points=False)
    manager.register(GradientForm(), "gradient-form")
    monkeypatch.setattr(plugin_manager, "get_plugin_manager", lambda: manager)
    assert available_explainers()["gradient"].description == "plain gradient"
    assert manager.owner("explain_register_export_forms", "gradient") == "gradient-form"
    model, example, _ = cnn
    result = export_onnx(
        model, example, tmp_path / "grad.onnx", explain="gradient", target_input=True
    )
    assert result.parity.passed and result.method == "gradient"


def test_input_x_gradient_through_strided_grouped_transposed_and_average_pooling(tmp_path):
    # Each backward decomposition: odd sizes under stride 2 (output padding), groups,
    # a transposed convolution and padded average pooling.
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=2),
        nn.ConvTranspose2d(4, 3, 3, stride=2),
        nn.Tanh(),
        nn.AvgPool2d(3, stride=2, padding=1),
        nn.Flatten(),
        nn.LazyLinear(5),
    )
    x = torch.rand(4, 2, 9, 9)
    model(x)  # materialise the lazy layer
    model.eval()
    result = export_onnx(model, x, tmp_path / "odd.onnx", explain="input_x_gradient")
    assert result.parity.explanation_max_rel <= 1e-3


def test_coda_export_runs_the_factorised_form(coda):
    """The QR basis is baked in at export: factorised layers where eager uses them."""
    from explain_onnx.adapters import CoDAGraph, FactorisedDAU

    model, x, _ = coda
    graph = CoDAGraph(model)
    forms = [isinstance(layer, FactorisedDAU) for layer in graph.layers]
    assert forms == [layer.effective_form == "factorised" for layer in model.layers]
    assert any(forms)
    with torch.no_grad():
        assert (graph(x) - model(x)).abs().max() <= 1e-5
