"""Models compiled with ``torch.compile`` are explained as their eager selves.

``backend="eager"`` keeps the tests fast: dynamo still traces the model (and, without the eager
switch, the explainers' hooks, which broke on their checks), but no kernels are generated.
"""

import copy

import pytest
import torch
from conftest import assert_same_state, state_fingerprint, write_user_module
from modbp_nets import vgg_bn
from torch import nn

from explain_capsules.layers import FullyConnectedCapsules
from explain_coda import CoDANet, LayerSpec
from explain_core import explain, explanation_mode, record_routing
from explain_core.metrics import cosine_similarity_convergence

METHODS = ["gradient", "lrp.epsilon_plus", "lrp.alpha_beta", "deeplift.rescale", "guided_bp"]


def compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="eager")


@pytest.fixture(scope="module")
def net_and_inputs():
    torch.manual_seed(0)
    return vgg_bn().eval(), torch.rand(3, 3, 8, 8, dtype=torch.float64)


@pytest.mark.parametrize("method", METHODS)
def test_compiled_model_gets_the_eager_models_map_and_keeps_its_state(net_and_inputs, method):
    net, x = net_and_inputs
    expected = explain(net, x, method, 1).attribution
    wrapper = compiled(copy.deepcopy(net))
    wrapper(x)  # compiled by the user before explaining
    before = state_fingerprint(wrapper)

    got = explain(wrapper, x, method, 1).attribution

    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_same_state(before, state_fingerprint(wrapper))
    torch.testing.assert_close(wrapper(x), net(x), rtol=0, atol=0)


def test_compiled_submodule_is_explained_through(net_and_inputs):
    net, x = net_and_inputs
    inner = copy.deepcopy(net)
    first = next(name for name, m in inner.named_children())
    setattr(inner, first, compiled(getattr(inner, first)))
    inner(x)
    for method in ("lrp.epsilon_plus", "deeplift.rescale"):
        torch.testing.assert_close(
            explain(inner, x, method, 0).attribution,
            explain(net, x, method, 0).attribution,
            rtol=0,
            atol=0,
        )


def test_csc_on_a_compiled_model_names_the_model_layers(net_and_inputs):
    net, x = net_and_inputs
    expected = cosine_similarity_convergence(net, x, "lrp.epsilon_plus")
    got = cosine_similarity_convergence(compiled(copy.deepcopy(net)), x, "lrp.epsilon_plus")
    assert got.layers == expected.layers
    assert got.median == pytest.approx(expected.median, abs=1e-12)


def test_routing_of_a_compiled_capsule_net_is_recorded():
    torch.manual_seed(0)
    net = nn.Sequential(
        FullyConnectedCapsules(6, 4, 3, 3, weight_std=0.3),
        FullyConnectedCapsules(4, 2, 3, 3, weight_std=0.3),
    ).eval()
    x = torch.randn(4, 6, 3)
    wrapper = compiled(copy.deepcopy(net))
    wrapper(x)
    with record_routing(net) as expected, record_routing(wrapper) as got:
        net(x)
        wrapper(x)
        assert set(got.layers) == set(expected.layers) == {"0", "1"}
        for layer in expected.layers:
            torch.testing.assert_close(got.couplings(layer), expected.couplings(layer))


def test_coda_contributions_of_a_compiled_net_detach_the_dynamic_weights():
    torch.manual_seed(0)
    specs = [LayerSpec(6, 4, 3, 1), LayerSpec(8, 5, 3, 2), LayerSpec(4, 6, 1, 1)]
    net = CoDANet(specs, (2, 7, 9)).eval()
    x = torch.rand(2, 2, 7, 9)
    wrapper = compiled(copy.deepcopy(net))
    wrapper(x)
    expected = explain(net, x, "coda.contributions", 1).attribution
    torch.testing.assert_close(explain(wrapper, x, "coda.contributions", 1).attribution, expected)
    with explanation_mode(wrapper):
        x = x.clone().requires_grad_(True)
        wrapper(x)[:, 1].sum().backward()
    with explanation_mode(net):
        reference = x.detach().clone().requires_grad_(True)
        net(reference)[:, 1].sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)


def test_compiled_models_export_to_onnx_as_their_eager_selves(net_and_inputs, tmp_path):
    for module in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(module, reason="the onnx extra is not installed")
    from explain_onnx import OnnxSession, export_onnx

    net, x = net_and_inputs
    net, x = copy.deepcopy(net).float(), x.float()
    nested = copy.deepcopy(net)
    nested[0] = compiled(nested[0])
    for name, model in (("whole", compiled(copy.deepcopy(net))), ("nested", nested)):
        model(x)
        before = state_fingerprint(model)
        path = tmp_path / f"{name}.onnx"
        result = export_onnx(model, x, path, explain="lrp.epsilon_plus")
        assert result.parity is not None and result.parity.cases
        logits, relevance = OnnxSession(path).run(x.numpy())
        torch.testing.assert_close(torch.from_numpy(logits), net(x), rtol=1e-4, atol=1e-4)
        expected = explain(net, x, "lrp.epsilon_plus").attribution
        torch.testing.assert_close(torch.from_numpy(relevance), expected, rtol=1e-3, atol=1e-6)
        assert_same_state(before, state_fingerprint(model))
    assert isinstance(nested[0], type(compiled(nn.Linear(1, 1))))


FACTORIES = """
import torch
from torch import nn


def plain():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def whole():
    return torch.compile(plain(), backend="eager")


def nested():
    model = plain()
    model[2] = torch.compile(model[2], backend="eager")
    return model
"""


@pytest.mark.parametrize("factory", ["plain", "whole", "nested"])
@pytest.mark.parametrize("saved_from", ["plain", "whole", "nested"])
def test_weights_load_into_compiled_factories(tmp_path, monkeypatch, factory, saved_from):
    from safetensors.torch import save_file

    from explain_core.loading import load_model

    name = write_user_module(tmp_path, monkeypatch, "compiledmodels", FACTORIES)
    trained = load_model(f"{name}:{saved_from}")
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(1.0)
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(weights))

    model = load_model(f"{name}:{factory}", weights)

    x = torch.randn(5, 4)
    torch.testing.assert_close(model(x), trained(x), rtol=0, atol=0)
    assert explain(model, x, "lrp.epsilon", 0).attribution.shape == x.shape
