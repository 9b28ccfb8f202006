"""PatternNet / PatternAttribution: estimators, streaming, save/load, architecture checks."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, state_fingerprint
from modbp_nets import vgg_bn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from explain_core import explain
from explain_core.errors import InvalidInputError, ModelRunError
from explain_modbp import PatternMismatchError
from explain_modbp.pattern import Patterns, fit_patterns

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_linear_estimator_is_equation_9():
    layer = nn.Sequential(nn.Linear(5, 3)).double().eval()
    data = torch.randn(400, 5, dtype=torch.float64) @ torch.randn(5, 5, dtype=torch.float64)
    patterns = fit_patterns(layer, data, estimator="linear", batch_size=64)
    cov = torch.cov(data.T)
    w = layer[0].weight.detach()
    expected = (cov @ w.T / (w @ cov @ w.T).diag()).T  # a_i = cov[h] w_i / (w_iᵀ cov[h] w_i)
    torch.testing.assert_close(patterns.patterns["0"], expected)
    assert patterns.samples == 400


@pytest.mark.parametrize("estimator", ["linear", "two_component"])
def test_conv_patterns_match_unfolded_covariances(estimator):
    torch.manual_seed(1)
    model = (
        nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 2))
        .double()
        .eval()
    )
    x = torch.randn(20, 2, 4, 4, dtype=torch.float64)
    patterns = fit_patterns(model, x, estimator=estimator, batch_size=7)
    conv = model[0]
    patches = F.unfold(x, 3, padding=1).transpose(1, 2).reshape(-1, 18)  # (samples·positions, 18)
    outputs = conv(x).detach().permute(0, 2, 3, 1).reshape(-1, 3)
    w = conv.weight.detach().reshape(3, 18)
    for j in range(3):
        keep = outputs[:, j] > 0 if estimator == "two_component" else slice(None)
        xs, ys = patches[keep], outputs[keep, j]
        cov = ((xs - xs.mean(0)) * (ys - ys.mean())[:, None]).mean(0)
        expected = cov / (w[j] @ cov)
        torch.testing.assert_close(patterns.patterns["0"][j].reshape(18), expected)
    # the output layer has no ReLU after it: the linear pattern in both estimators
    h = model[2](model[1](conv(x))).detach()
    cov = torch.cov(h.T)
    w = model[3].weight.detach()
    expected = (cov @ w.T / (w @ cov @ w.T).diag()).T
    torch.testing.assert_close(patterns.patterns["3"], expected)


def test_streaming_over_a_dataloader_equals_one_batch():
    model = vgg_bn()
    x = torch.randn(40, 3, 8, 8, dtype=torch.float64)
    labels = torch.zeros(40, dtype=torch.long)
    whole = fit_patterns(model, x, batch_size=40)
    loader = DataLoader(TensorDataset(x, labels), batch_size=6)
    streamed = fit_patterns(model, loader)
    assert streamed.samples == 40
    for name in whole.patterns:
        torch.testing.assert_close(streamed.patterns[name], whole.patterns[name])
    assert set(whole.patterns) == {"0", "3", "7", "12", "14"}  # BatchNorms merged


def test_patternnet_and_pattern_attribution_match_manual_chain(tmp_path):
    torch.manual_seed(2)
    model = (
        nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        .double()
        .eval()
    )
    data = torch.randn(200, 4, dtype=torch.float64)
    patterns = fit_patterns(model, data)
    x = torch.randn(3, 4, dtype=torch.float64)
    h1 = model[1](model[0](x)).detach()
    h2 = model[3](model[2](h1)).detach()
    for method, attribution in (("patternnet", False), ("pattern_attribution", True)):
        a = {
            name: patterns.patterns[name] * (model[int(name)].weight.detach() if attribution else 1)
            for name in ("0", "2", "4")
        }
        r = F.one_hot(torch.tensor([2, 0, 1]), 3).double()
        r = (r @ a["4"]) * (h2 > 0)
        r = (r @ a["2"]) * (h1 > 0)
        expected = r @ a["0"]
        got = explain(model, x, method, target=[2, 0, 1], patterns=patterns)
        torch.testing.assert_close(got.attribution, expected)
    path = tmp_path / "patterns.safetensors"
    patterns.save(path)
    loaded = Patterns.load(path)
    assert loaded.layers == patterns.layers and loaded.estimator == "two_component"
    again = explain(model, x, "patternnet", target=[2, 0, 1], patterns=str(path))
    first = explain(model, x, "patternnet", target=[2, 0, 1], patterns=patterns)
    torch.testing.assert_close(again.attribution, first.attribution)


def test_patterns_of_another_architecture_and_missing_patterns_are_errors(tmp_path):
    model = vgg_bn()
    before = state_fingerprint(model)
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    patterns = fit_patterns(model, x)
    assert_same_state(before, state_fingerprint(model))
    other = (
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5))
        .double()
        .eval()
    )
    with pytest.raises(PatternMismatchError, match="different architecture"):
        explain(other, x[:2], "pattern_attribution", patterns=patterns)
    del patterns.patterns["14"]
    with pytest.raises(PatternMismatchError, match="'14'"):
        explain(model, x[:2], "patternnet", patterns=patterns)
    with pytest.raises(InvalidInputError, match="needs patterns fitted from data"):
        explain(model, x[:2], "patternnet")
    with pytest.raises(InvalidInputError, match="no patterns file"):
        explain(model, x[:2], "patternnet", patterns=str(tmp_path / "missing.safetensors"))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(InvalidInputError, match="holds no explain-modbp patterns"):
        Patterns.load(tmp_path / "other.safetensors")
    with pytest.raises(InvalidInputError, match="estimator"):
        fit_patterns(model, x, estimator="quadratic")
    with pytest.raises(ModelRunError, match=r"pattern data are torch.float32 .* torch.float64"):
        fit_patterns(model, x.float())  # found by the zoo: a raw error from inside conv2d
    with pytest.raises(InvalidInputError, match="pattern data contain NaN"):
        fit_patterns(model, x.clone().fill_(float("nan")))
    assert_same_state(before, state_fingerprint(model))


def test_a_map_that_overflows_is_one_clear_error_never_nan():
    # The real torchvision ResNet-50's PatternNet overflowed float32 through its 50 layers
    # (benchmarks/check_torchvision_zoo.py); patterns this large do it in two layers here.
    import dataclasses

    from explain_core import NumericalError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.rand(4, 6)
    fitted = fit_patterns(model, torch.rand(64, 6))
    huge = dataclasses.replace(
        fitted, patterns={name: p * 1e25 for name, p in fitted.patterns.items()}
    )
    with pytest.raises(NumericalError, match=r"NaN or infinite attributions for samples \[0, 1"):
        explain(model, x, "patternnet", 0, patterns=huge)
    assert torch.isfinite(explain(model, x, "patternnet", 0, patterns=fitted).attribution).all()
    # the advice works: in float64 the same patterns give a finite map
    double = explain(model.double(), x.double(), "patternnet", 0, patterns=huge)
    assert torch.isfinite(double.attribution).all()


def _data_normalised(affine: bool) -> nn.Sequential:
    """A BatchNorm that normalises the input (ST-GCN's "data BN"), with or without affine."""
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.BatchNorm2d(3, affine=affine), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten()
    )
    model = nn.Sequential(*model, nn.Linear(4 * 36, 3)).eval()
    model[0].running_mean.copy_(torch.tensor([0.3, 0.5, 0.7]))
    model[0].running_var.copy_(torch.tensor([0.5, 2.0, 1.5]))
    return model


def test_a_batchnorm_without_affine_gets_the_patterns_of_the_same_affine_one():
    # its weight is None, which fit_patterns read for the dtype (a raw AttributeError)
    x = torch.rand(32, 3, 8, 8)
    plain, affine = _data_normalised(False), _data_normalised(True)  # weight 1, bias 0
    fitted, expected = fit_patterns(plain, x), fit_patterns(affine, x)
    assert fitted.patterns.keys() == expected.patterns.keys()
    for name, pattern in expected.patterns.items():
        torch.testing.assert_close(fitted.patterns[name], pattern)
    for method in ("patternnet", "pattern_attribution"):
        torch.testing.assert_close(
            explain(plain, x[:4], method, 1, patterns=fitted).attribution,
            explain(affine, x[:4], method, 1, patterns=expected).attribution,
        )


def test_patterns_of_a_compiled_model_are_its_eager_models():
    # dynamo traced into fit_patterns' own checks and failed there; explain() unwraps it
    model = vgg_bn()
    x = torch.randn(16, 3, 8, 8, dtype=torch.float64)
    expected = fit_patterns(model, x)
    fitted = fit_patterns(torch.compile(model, backend="eager"), x)
    for name, pattern in expected.patterns.items():
        torch.testing.assert_close(fitted.patterns[name], pattern)


def test_patterns_of_a_compiled_submodule_are_its_eager_modules():
    # only a compiled model was unwrapped: a compiled submodule raised a raw AttributeError
    model = vgg_bn()
    x = torch.randn(16, 3, 8, 8, dtype=torch.float64)
    expected = fit_patterns(model, x)
    compiled = copy.deepcopy(model)
    compiled[0] = torch.compile(compiled[0], backend="eager")
    fitted = fit_patterns(compiled, x)
    assert fitted.patterns.keys() == expected.patterns.keys()
    for name, pattern in expected.patterns.items():
        torch.testing.assert_close(fitted.patterns[name], pattern)
    torch.testing.assert_close(  # the eager model's patterns fit the compiled one's layers
        explain(compiled, x[:2], "pattern_attribution", 1, patterns=expected).attribution,
        explain(model, x[:2], "pattern_attribution", 1, patterns=expected).attribution,
    )
