"""Bad input to explain() and Explainer: clear errors, and model and inputs left unchanged."""

from __future__ import annotations

import copy
import inspect
import sys

import numpy as np
import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import (
    Explainer,
    InvalidInputError,
    ModelRunError,
    ModelStateError,
    UnsupportedModelError,
    explain,
    explain_inputs,
)
from explain_core.plugin_manager import get_registry

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# One method per family: plain autograd, autograd with baselines, and traced modified backprop.
METHODS = ("gradient", "integrated_gradients", "lrp.epsilon")


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3)
    ).eval()


def images(batch: int = 2) -> torch.Tensor:
    return torch.rand(batch, 1, 4, 4)


class Wrapped(nn.Module):
    """A small CNN whose forward does something awkward before or after it."""

    def __init__(self, forward) -> None:
        super().__init__()
        self.net = cnn()
        self._forward = forward

    def forward(self, x: torch.Tensor):
        return self._forward(self.net, x)


def _normalise_in_place(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # allowed on a leaf, and writes into whatever tensor it was given
        x.sub_(0.5)
    return net(x)


@pytest.mark.parametrize("method", ["gradient", "integrated_gradients"])
def test_a_model_writing_into_its_input_leaves_the_callers_tensors_unchanged(method):
    model = Wrapped(_normalise_in_place).eval()
    x, baselines = images(), torch.full((2, 1, 4, 4), 0.25)
    x_before, baselines_before = x.clone(), baselines.clone()
    state = state_fingerprint(model)
    options = {"baselines": baselines} if method == "integrated_gradients" else {}
    explain(model, x, method, 1, **options)
    assert torch.equal(x, x_before) and x._version == x_before._version
    assert torch.equal(baselines, baselines_before)
    assert_same_state(state, state_fingerprint(model))


@pytest.mark.parametrize("method", METHODS)
def test_in_place_relu_on_the_input_is_refused_clearly_and_changes_nothing(method):
    model = Wrapped(lambda net, x: net(torch.relu_(x))).eval()
    x = images() - 0.5
    before = x.clone()
    state = state_fingerprint(model)
    with pytest.raises(InvalidInputError, match=r"modifies its input in place.*inplace=False"):
        explain(model, x, method, 1)
    assert torch.equal(x, before)
    assert_same_state(state, state_fingerprint(model))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("method", METHODS)
def test_inputs_of_another_dtype_than_the_model_name_both_and_the_conversion(method, dtype):
    model = cnn()
    state = state_fingerprint(model)
    with pytest.raises(InvalidInputError, match=rf"inputs are {dtype}.*x\.to\(torch\.float32\)"):
        explain(model, images().to(dtype), method, 1)
    assert_same_state(state, state_fingerprint(model))


def test_non_finite_inputs_name_the_samples():
    x = images(3)
    x[2, 0, 1, 1] = float("inf")
    with pytest.raises(InvalidInputError, match=r"NaN or infinite values in samples \[2\]"):
        explain(cnn(), x, "gradient", 1)


def test_meta_inputs_and_meta_models_are_refused_before_anything_runs():
    with pytest.raises(InvalidInputError, match="inputs are meta tensors"):
        explain(cnn(), torch.empty(2, 1, 4, 4, device="meta"), "gradient", 1)
    with pytest.raises(InvalidInputError, match=r"meta device.*to_empty"):
        explain(cnn().to("meta"), torch.empty(2, 1, 4, 4, device="meta"), "gradient", 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_inputs_on_another_device_than_the_model_say_how_to_move_them():
    with pytest.raises(InvalidInputError, match=r"model's parameters are on cpu.*x\.to\('cpu'\)"):
        explain(cnn(), images().cuda(), "gradient", 1)


def test_inference_tensors_work_but_a_call_inside_inference_mode_is_refused():
    model, x = cnn(), images()
    with torch.inference_mode():
        frozen = x.clone()
    result = explain(model, frozen, "gradient", 1)
    torch.testing.assert_close(result.attribution, explain(model, x, "gradient", 1).attribution)
    with torch.inference_mode(), pytest.raises(InvalidInputError, match=r"outside torch\.infer"):
        explain(model, x, "gradient", 1)


@pytest.mark.parametrize("method", [*METHODS, "deeplift.rescale"])
def test_a_model_made_inside_inference_mode_is_refused_and_its_copy_explained(method):
    # Its parameters are inference tensors, which autograd cannot save for backward: torch
    # raised "Inference tensors cannot be saved for backward" (the LRP engine: "... do not
    # track version counter") from inside the method.
    x = images()
    torch.manual_seed(0)
    with torch.inference_mode():
        model = cnn()
    with pytest.raises(ModelStateError, match=r"inference tensors \('0\.weight' and 3 more\)"):
        explain(model, x, method, 1)
    copied = explain(copy.deepcopy(model), x, method, 1)  # what the message advises
    torch.manual_seed(0)
    expected = explain(cnn(), x, method, 1)  # the same seed: the same weights
    torch.testing.assert_close(copied.attribution, expected.attribution)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (2, 4, 4), (2, 1, 5, 5), (2, 1, 1, 4, 4)], ids=str)
def test_inputs_the_model_cannot_run_on_get_one_clear_error(method, shape):
    model = cnn()
    state = state_fingerprint(model)
    with pytest.raises(InvalidInputError, match=r"cannot run on inputs of shape") as caught:
        explain(model, torch.rand(shape), method, 1)
    assert str(shape) in str(caught.value) and "training data" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's message stays chained
    assert isinstance(caught.value, RuntimeError)  # what callers caught before it was explained
    assert_same_state(state, state_fingerprint(model))


@pytest.mark.parametrize("method", METHODS)
def test_one_sample_without_its_batch_axis_is_told_to_add_it(method):
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 3)
    ).eval()
    shape = (1, 4, 4)
    state = state_fingerprint(model)
    with pytest.raises(InvalidInputError, match=r"lack the batch axis") as caught:
        explain(model, torch.rand(shape), method, 1)  # torch raises ValueError("expected 4D …")
    assert f"x.unsqueeze(0), of shape {(1, *shape)}" in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)
    assert_same_state(state, state_fingerprint(model))


def test_the_models_own_error_on_valid_inputs_propagates_unchanged():
    calls = []

    def fail_once(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("user model failure")
        return net(x)

    with pytest.raises(RuntimeError, match="user model failure") as caught:
        explain(Wrapped(fail_once).eval(), images(), "gradient", 1)
    assert not isinstance(caught.value, InvalidInputError)


@pytest.mark.parametrize("method", [*METHODS, "dynamic.contributions"])
def test_an_empty_batch_asks_for_a_sample(method):
    with pytest.raises(InvalidInputError, match=r"0 samples.*pass at least one"):
        explain(cnn(), images()[:0], method)


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize(
    "method", ["gradient", "input_x_gradient", "integrated_gradients", "dynamic.contributions"]
)
def test_a_model_returning_a_tuple_or_dict_is_told_to_return_one_tensor(method, kind):
    wrap = {"tuple": lambda y: (y, y), "dict": lambda y: {"logits": y}}[kind]
    model = Wrapped(lambda net, x: wrap(net(x))).eval()
    with pytest.raises(InvalidInputError, match=rf"one tensor.*returned a {kind}; wrap it"):
        explain(model, images(), method)


@pytest.mark.parametrize("method", METHODS)
def test_a_model_output_that_is_not_2d_is_refused(method):
    model = Wrapped(lambda net, x: net(x)[:, :, None]).eval()
    with pytest.raises(InvalidInputError, match=r"\(batch, n_outputs\)"):
        explain(model, images(), method, 1)


@pytest.mark.parametrize("method", [*METHODS, "excitation_bp", "input_x_gradient"])
def test_non_finite_model_outputs_name_the_samples(method):
    def nan_for_second_sample(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        second = torch.arange(x.shape[0])[:, None] == 1  # a constant, so every engine traces it
        return net(x) + torch.where(second, float("nan"), 0.0)

    with pytest.raises(InvalidInputError, match=r"output is not finite.*samples \[1\] of 3"):
        explain(Wrapped(nan_for_second_sample).eval(), images(3), method)


@pytest.mark.parametrize("target", ["3", b"3", ["1", "2"], [[1], [1, 2]], {"a": 1}], ids=repr)
def test_targets_of_the_wrong_kind_list_the_accepted_forms(target):
    with pytest.raises(InvalidInputError, match=r"target must be None \(the predicted class\)"):
        explain(cnn(), images(), "gradient", target)


def test_the_callers_target_tensor_is_not_handed_back():
    target = torch.tensor([0, 2])
    result = explain(cnn(), images(), "gradient", target)
    assert torch.equal(result.target, target) and result.target is not target


@pytest.mark.parametrize(
    ("method", "options", "phrase"),
    [
        ("integrated_gradients", {"steps": "10"}, r"'steps'.*must be an integer; got '10' \(str\)"),
        ("integrated_gradients", {"steps": 2.5}, r"must be an integer; got 2\.5 \(float\)"),
        ("integrated_gradients", {"steps": True}, r"must be an integer; got True \(bool\)"),
        ("lrp.epsilon", {"epsilon": float("nan")}, r"'epsilon'.*finite number; got nan"),
        ("lrp.epsilon", {"epsilon": "a"}, r"finite number; got 'a' \(str\)"),
        ("lrp.gamma", {"gamma": float("nan")}, r"'gamma'.*finite number"),
        ("lrp.alpha_beta", {"alpha": float("inf")}, r"'alpha'.*finite number; got inf"),
        ("lrp.zb", {"low": float("nan"), "high": 1.0}, r"'low'.*finite number, a finite tensor"),
        ("lrp.zb", {"low": torch.full((1, 4, 4), float("nan")), "high": 1.0}, "finite tensor"),
        ("rectgrad", {"q": "high"}, r"'q'.*finite number; got 'high'"),
        ("guided_bp", {"times_input": "yes"}, r"'times_input'.*True or False; got 'yes'"),
        ("deeplift.rescale", {"maxpool": 3}, r"'maxpool'.*a string; got 3 \(int\)"),
    ],
    ids=repr,
)
def test_option_values_of_the_wrong_type_or_not_finite_are_refused(method, options, phrase):
    with pytest.raises(InvalidInputError, match=phrase) as caught:
        explain(cnn(), images(), method, 1, **options)
    assert str(caught.value).startswith(f"option {next(iter(options))!r} of method {method!r}")
    with pytest.raises(InvalidInputError, match=phrase):
        Explainer(cnn(), method, **options)  # refused when the explainer is built


def test_options_of_compatible_types_are_accepted():
    model, x = cnn(), images()
    explain(model, x, "integrated_gradients", 1, steps=np.int64(3), internal_batch_size=4)
    explain(model, x, "lrp.epsilon", 1, epsilon=1)  # an int where a float is expected
    explain(model, x, "lrp.zb", 1, low=torch.zeros(1, 4, 4), high=1)


def test_every_registered_methods_defaults_pass_the_type_check():
    for name, spec in get_registry().items():
        defaults = {
            key: value
            for key, value in spec.options().items()
            if value is not inspect.Parameter.empty
        }
        try:
            spec.create(**defaults)
        except InvalidInputError as error:  # the factory's own checks may still need values
            assert not str(error).startswith("option "), name


def test_baselines_that_are_not_numbers_or_tensors_are_refused():
    with pytest.raises(InvalidInputError, match=r"baselines must be a tensor.*got str"):
        explain(cnn(), images(), "integrated_gradients", 1, baselines="zero")


def test_a_model_that_is_not_a_module_is_refused():
    with pytest.raises(InvalidInputError, match=r"torch\.nn\.Module; got function"):
        explain(lambda x: x.flatten(1)[:, :3], images(), "gradient", 1)


# ------------------------------------------------------- the model's own errors and writes
class SecondCallFails(nn.Module):
    """Runs once, then raises its own (non-shape) error on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= 2:
            raise RuntimeError("boom")
        return self.fc(x)


def test_a_models_own_error_is_not_blamed_on_the_inputs_shape():
    model = SecondCallFails().eval()
    with pytest.raises(InvalidInputError, match=r"forward raised RuntimeError\('boom'\)") as caught:
        explain(model, torch.rand(4, 6), "integrated_gradients", 0)  # 2nd call: baseline output
    message = str(caught.value)
    assert "model's own error" in message and "training data" not in message
    assert str(caught.value.__cause__) == "boom"  # the original, chained
    assert isinstance(caught.value, RuntimeError)


def test_run_once_blames_the_shape_only_for_shape_errors():
    from explain_core.validation import run_once

    def own_error(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("labels file missing")

    with pytest.raises(InvalidInputError, match=r"forward raised ValueError\('labels file") as own:
        run_once(own_error, images())
    assert "shape" not in str(own.value).split(";")[0].replace("of shape (2, 1, 4, 4)", "")
    with pytest.raises(InvalidInputError, match=r"cannot run on inputs of shape \(2, 3, 4, 4\)"):
        run_once(cnn(), torch.rand(2, 3, 4, 4))


@pytest.mark.parametrize("target", [[], np.array([], dtype=np.int64), torch.tensor([])], ids=repr)
def test_an_empty_target_list_is_named_as_such(target):
    with pytest.raises(InvalidInputError, match=r"target is empty.*one int per sample \(2\)"):
        explain(cnn(), images(), "gradient", target)


class ScalesItsWeight(nn.Module):
    """Multiplies its own weight in place on every forward pass, as some user code does."""

    def __init__(self, via_data: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.via_data = via_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.via_data:
            self.fc.weight.data.mul_(1.01)  # invisible to autograd's version counter
        else:
            with torch.no_grad():
                self.fc.weight.mul_(1.01)
        return self.fc(x)


@pytest.mark.parametrize("via_data", [True, False], ids=["data", "no_grad"])
@pytest.mark.parametrize("method", ["gradient", "integrated_gradients", "lrp.epsilon"])
def test_a_forward_that_changes_its_weights_is_refused(method, via_data):
    model = ScalesItsWeight(via_data).eval()
    weight = model.fc.weight.detach().clone()
    with pytest.raises(ModelStateError, match=r"model's forward modified its parameter\(s\) fc\.w"):
        explain(model, torch.rand(2, 6), method, 0)
    assert not torch.equal(model.fc.weight, weight)  # the model's own doing, named, not undone


def test_a_forward_that_changes_its_weights_and_then_raises_keeps_its_error_with_a_note():
    class ScalesThenFails(ScalesItsWeight):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            super().forward(x)
            raise RuntimeError("later failure")

    model = ScalesThenFails(via_data=True).eval()
    with pytest.raises(RuntimeError, match="later failure") as raised:
        explain(model, torch.rand(2, 6), "gradient", 0)
    if sys.version_info >= (3, 11):
        assert any("fc.weight" in note for note in raised.value.__notes__)


def test_a_valid_call_leaves_parameter_versions_alone():
    # Caches keyed on parameter versions (the modbp plan cache) must stay valid.
    model = cnn()
    versions = [p._version for p in model.parameters()]
    explain(model, images(), "gradient", 1)
    assert [p._version for p in model.parameters()] == versions


class _BroadcastingNormalize(nn.Module):
    """Normalisation with (1, C, 1, 1) buffers: one unbatched (C, H, W) image becomes a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((1, 3, 1, 1), 0.5))
        self.register_buffer("std", torch.full((1, 3, 1, 1), 0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def test_a_model_that_returns_other_rows_than_samples_is_told_about_the_batch_axis():
    torch.manual_seed(0)
    model = nn.Sequential(
        _BroadcastingNormalize(), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 5)
    ).eval()
    image = torch.rand(3, 4, 4)  # one image without its batch axis
    advice = r"pass x\.unsqueeze\(0\), of shape \(1, 3, 4, 4\)"
    for method in ("gradient", "lrp.epsilon"):
        with pytest.raises(InvalidInputError, match=advice):
            explain(model, image, method, target=0)
    batched = explain(model, image.unsqueeze(0), "gradient", target=0)
    assert batched.attribution.shape == (1, 3, 4, 4)


class _FixedRows(nn.Module):
    """Returns the first three rows only: right for a batch of three, wrong for any larger."""

    def __init__(self) -> None:
        super().__init__()
        self.net = cnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)[:3]


class _FixedView(nn.Module):
    """Flattens with the batch size written in (x.view(3, -1)): runs on batches of three only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).view(3, -1))


class _RowWeights(nn.Module):
    """Scales row i by a buffer's entry i: raises inside forward on more than three rows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = cnn()
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale[: x.shape[0], None]


@pytest.mark.parametrize(
    ("model", "methods", "other"),
    [
        (_FixedRows, ("integrated_gradients", "smoothgrad", "deeplift.rescale"), 4),
        (_FixedView, ("integrated_gradients", "deeplift.rescale", "lrp.epsilon"), 1),
        (_RowWeights, ("integrated_gradients", "smoothgrad", "deeplift.rescale"), 4),
    ],
)
def test_a_model_that_runs_only_at_its_batch_size_is_told_so(model, methods, other):
    # The methods run the model on batches of their own sizes; before, these raised torch's
    # errors about mismatched sizes from deep inside the method.
    torch.manual_seed(0)
    net = model().eval()
    x = images(3)
    assert explain(net, x, "gradient", target=1).attribution.shape == x.shape  # it runs at 3
    for method in methods:
        with pytest.raises(InvalidInputError) as raised:
            explain(net, x, method, target=1)
        message = str(raised.value)
        assert f"runs on this batch of 3 sample(s) but not on a batch of {other}" in message
        assert "x.view(x.shape[0], -1)" in message and "internal_batch_size=3" in message


def test_the_advised_internal_batch_size_runs_a_model_fixed_to_its_batch_size():
    torch.manual_seed(0)
    net, x = _FixedRows().eval(), images(3)
    fixed = explain(net, x, "integrated_gradients", target=1, internal_batch_size=3)
    reference = explain(net.net, x, "integrated_gradients", target=1)  # the same rows, any batch
    torch.testing.assert_close(fixed.attribution, reference.attribution)


def test_a_segmentation_output_is_refused_with_the_ways_to_explain_a_pixel():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 1)).eval()
    x = images()
    advice = r"Explainer\(model, method\)\.attribute\(x, target=\(c, i, j\)\)"
    with pytest.raises(InvalidInputError, match=rf"got \(2, 2, 4, 4\)\. For an output.*{advice}"):
        explain(model, x, "gradient", 1)
    with pytest.raises(InvalidInputError, match=rf"got 3 values\. A tuple that indexes.*{advice}"):
        explain(model, x, "gradient", (1, 2, 3))  # Captum's form, given to explain()
    pixel = Explainer(model, "gradient").attribute(x, target=(1, 2, 3))  # what both advise
    xg = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(model(xg)[:, 1, 2, 3].sum(), xg)
    torch.testing.assert_close(pixel, expected)


@pytest.mark.parametrize("method", ["gradient", "lrp.epsilon"])
def test_an_index_error_in_forward_is_the_model_s_own_not_the_inputs_shape(method):
    # A wrong index in forward; "pass inputs shaped like the model's training data" misled
    class WrongIndex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)[:, [0, 1, 7]]

    with pytest.raises(ModelRunError, match=r"raised IndexError\('index 7 is out of bounds"):
        explain(WrongIndex().eval(), torch.rand(2, 4), method, 1)


class _PositionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x * mask)


class _KeywordMask(_PositionalMask):
    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x * mask)


@pytest.mark.parametrize("model_type", [_PositionalMask, _KeywordMask])
@pytest.mark.parametrize("method", METHODS)
def test_a_forward_with_another_input_is_told_the_way_to_explain_it(model_type, method):
    # Python's TypeError for the missing argument escaped explain() raw
    torch.manual_seed(0)
    model = model_type().eval()
    x, mask = torch.rand(2, 4), torch.tensor([[1.0, 0.0, 1.0, 1.0]]).repeat(2, 1)
    before = state_fingerprint(model)
    with pytest.raises(ModelRunError, match=r"needs more than the one input.*explain_inputs\("):
        explain(model, x, method, 1)
    assert_same_state(before, state_fingerprint(model))
    with pytest.raises(InvalidInputError, match=r"one torch.Tensor.*a tuple of 2.*explain_inputs"):
        explain(model, (x, mask), method, 1)
    with pytest.raises(InvalidInputError, match=r"one torch.Tensor.*a dict of 2.*explain_inputs"):
        explain(model, {"x": x, "mask": mask}, method, 1)
    # the advice runs: the gradient at x with the mask held, as autograd gives it
    explained = explain_inputs(model, {"x": x, "mask": mask}, "gradient", 1, explained="x")
    xg = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(model(xg, mask=mask)[:, 1].sum(), xg)
    torch.testing.assert_close(explained.attribution, expected)


def _frozen_features(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # a frozen feature extractor
        features = net[:3](x)
    return net[3](features)


@pytest.mark.parametrize(
    "forward",
    [_frozen_features, lambda net, x: net[3](net[:3](x).detach())],
    ids=["no_grad", "detach"],
)
@pytest.mark.parametrize(
    "method",
    [
        "gradient",
        "input_x_gradient",
        "smoothgrad",
        "integrated_gradients",
        "dynamic.contributions",
        "lrp.epsilon",
    ],
)
def test_a_forward_that_cuts_the_path_from_its_input_is_refused_by_every_method(method, forward):
    # the gradient methods let torch's "appears to not have been used in the graph" escape
    with pytest.raises(UnsupportedModelError, match=r"no_grad\(\)|'detach'"):
        explain(Wrapped(forward), images(), method, 1)


@pytest.mark.parametrize("method", [*METHODS, "deeplift.rescale"])
def test_a_lazy_model_not_run_yet_is_refused_and_explained_after_one_forward(method):
    # reading its parameters raised torch's "Attempted to use an uninitialized parameter"
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.LazyConv2d(2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    x = images()
    with pytest.raises(ModelStateError, match=r"uninitialised parameters \('0\.weight' and 3 "):
        explain(lazy.eval(), x, method, 1)
    lazy(x)  # what the message advises: the shapes are set, the weights drawn
    torch.manual_seed(0)
    plain = cnn()
    plain.load_state_dict(lazy.state_dict())
    expected = explain(plain, x, method, 1).attribution
    torch.testing.assert_close(explain(lazy, x, method, 1).attribution, expected)


def _spectral(linear: nn.Linear, form: str) -> nn.Module:
    if form == "parametrization":
        return nn.utils.parametrizations.spectral_norm(linear)
    return nn.utils.spectral_norm(linear)  # the hook-based original


@pytest.mark.parametrize("method", [*METHODS, "deeplift.rescale"])
@pytest.mark.parametrize("form", ["parametrization", "hook"])
def test_spectral_normalisation_in_training_mode_is_refused(method, form):
    # each forward took a step of its power iteration: the LRP methods blamed the layer's
    # forward, the others explained a weight the user's own forward never used
    torch.manual_seed(0)
    model = nn.Sequential(_spectral(nn.Linear(4, 5), form), nn.ReLU(), nn.Linear(5, 3))
    x = torch.randn(2, 4)
    with pytest.raises(ModelStateError, match=r"'0.*' is in training mode; call model\.eval"):
        explain(model.train(), x, method, 1)
    model.eval()
    plain = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    with torch.no_grad():
        model(x)  # the hook sets the normalised weight in a forward (fixed in eval mode)
        plain[0].weight.copy_(model[0].weight)
        plain[0].bias.copy_(model[0].bias)
        plain[2].load_state_dict(model[2].state_dict())
    expected = explain(plain, x, method, 1).attribution
    torch.testing.assert_close(explain(model, x, method, 1).attribution, expected)


@pytest.mark.parametrize("method", ["integrated_gradients", "deeplift.rescale"])
def test_a_reference_where_the_model_is_not_finite_is_refused(method):
    # its completeness gap (delta) came back NaN, silently
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double().eval()
    with torch.no_grad():
        model[0].weight.fill_(10.0)
    x = torch.randn(2, 4, dtype=torch.float64)
    overflowing = torch.full_like(x, 1e308)  # finite, but 10 × 1e308 overflows to inf
    with pytest.raises(
        InvalidInputError, match=r"output at the reference input .* samples \[0, 1\]"
    ):
        explain(model, x, method, 1, baselines=overflowing)
    result = explain(model, x, method, 1, baselines=torch.full_like(x, 0.5))
    assert torch.isfinite(result.delta).all()


def _prepared(form: str) -> nn.Module:
    """A small CNN prepared for quantization: observers (PTQ) or fake quantization (QAT)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        torch.ao.quantization.QuantStub(), cnn(), torch.ao.quantization.DeQuantStub()
    )
    if form == "post-training":
        model.qconfig = torch.ao.quantization.get_default_qconfig("fbgemm")
        torch.ao.quantization.prepare(model.eval(), inplace=True)
    else:
        model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
        torch.ao.quantization.prepare_qat(model.train(), inplace=True)
    model(images())  # calibration
    return model.eval()


@pytest.mark.parametrize("method", [*METHODS, "deeplift.rescale"])
@pytest.mark.parametrize("form", ["post-training", "quantization-aware"])
def test_a_model_prepared_for_quantization_is_refused_not_calibrated(method, form):
    # its observers took in the explained images, path points and references, silently
    model = _prepared(form)
    before = state_fingerprint(model)
    with pytest.raises(ModelStateError, match=r"records statistics of every forward"):
        explain(model, images(), method, 1)
    assert_same_state(before, state_fingerprint(model))
    if form == "quantization-aware":  # the advice for fake quantization: explained as it is
        model.apply(torch.ao.quantization.disable_observer)
        before = state_fingerprint(model)
        if method in ("lrp.epsilon", "deeplift.rescale"):  # the rules see quantized weights
            with pytest.raises(UnsupportedModelError, match="it fake-quantizes its weights"):
                explain(model, images(), method, 1)
        else:
            assert torch.isfinite(explain(model, images(), method, 1).attribution).all()
        assert_same_state(before, state_fingerprint(model))


@pytest.mark.parametrize("method", [*METHODS, "deeplift.rescale"])
@pytest.mark.parametrize("conversion", ["convert", "quantize_dynamic"])
def test_a_model_converted_to_int8_is_refused_by_name(method, conversion):
    # its kernels have no backward: it was refused as a no_grad block in forward
    model = _prepared("post-training")
    if conversion == "convert":
        torch.ao.quantization.convert(model, inplace=True)
        refused = r"Quantize '0' is a quantized module"
    else:
        model = torch.ao.quantization.quantize_dynamic(cnn().eval(), {nn.Linear})
        refused = r"Linear '.*' is a quantized module"
    with pytest.raises(ModelStateError, match=refused + r".* on the float model"):
        explain(model, images(), method, 1)


def test_a_model_whose_observers_keep_no_statistics_is_explained():
    # float16_static_qconfig's PlaceholderObserver records nothing: refused as an observer
    torch.manual_seed(0)
    model = nn.Sequential(torch.ao.quantization.QuantStub(), cnn())
    model.qconfig = torch.ao.quantization.float16_static_qconfig
    torch.ao.quantization.prepare(model.eval(), inplace=True)
    before = state_fingerprint(model)
    x = images()
    got = explain(model, x, "gradient", 1).attribution
    assert_same_state(before, state_fingerprint(model))
    x.requires_grad_(True)
    (expected,) = torch.autograd.grad(model(x)[:, 1].sum(), x)
    torch.testing.assert_close(got, expected)
