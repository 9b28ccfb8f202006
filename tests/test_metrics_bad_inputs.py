"""Bad input to the metrics: a clear InvalidInputError (or ModelStateError), never a raw torch or
NumPy error, a silent NaN or a changed model."""

import numpy as np
import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import explain
from explain_core.errors import InvalidInputError, ModelStateError
from explain_core.metrics import (
    cascading_randomisation,
    cosine_similarity_convergence,
    localisation_score,
    map_ssim,
    matrix_chain_convergence,
    pixel_removal_curve,
    random_logit_ssim,
    removed_pixel_counts,
    to_maps,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).eval()


def bn_cnn() -> nn.Module:
    """A model in training mode whose forward would update BatchNorm's running statistics."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(256, 10)
    ).train()


X = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
T = torch.tensor([1, 2, 3, 4])
MAPS = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(2))


def fixed_maps(model, inputs, targets):  # a maps function that never calls the model
    return inputs[:, 0] * (1 + targets.view(-1, 1, 1))


def raises(match: str, error: type[Exception] = InvalidInputError):
    return pytest.raises(error, match=match)


# ------------------------------------------------------------- 1. the model stays unchanged
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m: random_logit_ssim(m, "gradient", X, T), id="random_logit"),
        pytest.param(lambda m: random_logit_ssim(m, fixed_maps, X, T), id="random_logit_fn"),
        pytest.param(lambda m: pixel_removal_curve(m, X, MAPS, T), id="pixel_removal"),
        pytest.param(lambda m: cascading_randomisation(m, fixed_maps, X, T, ["3"]), id="cascading"),
        pytest.param(lambda m: cosine_similarity_convergence(m, X, "gradient"), id="csc"),
    ],
)
def test_train_mode_is_refused_before_any_forward_pass(call):
    model = bn_cnn()
    before = state_fingerprint(model)
    with raises("training mode", ModelStateError):
        call(model)
    assert_same_state(before, state_fingerprint(model))


class Counting(nn.Module):
    """Counts its forward calls in an attribute, as a plain forward pass does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = cnn()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(x)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m: random_logit_ssim(m, fixed_maps, X, T), id="random_logit"),
        pytest.param(lambda m: pixel_removal_curve(m, X, MAPS, T, steps=2), id="pixel_removal"),
    ],
)
def test_own_forward_passes_leave_the_model_as_it_was(call):
    # The metrics only read the model (other threads may use it meanwhile): what its forward
    # stores on itself stays, as after a plain forward; nothing else changes.
    model = Counting().eval()
    before = state_fingerprint(model)
    call(model)
    assert model.calls > 0
    assert_same_state(before, state_fingerprint(model))


# --------------------------------------------------------------------------------- 2. targets
@pytest.mark.parametrize(
    ("target", "match"),
    [
        (-1, r"lie in \[0, 9\]"),
        (40, r"lie in \[0, 9\]"),
        (T[:2], "one int per sample"),
        (T.float(), "integers"),
        ("3", "target must be"),
    ],
)
def test_pixel_removal_targets_follow_explains_rules(target, match):
    with raises(match):
        pixel_removal_curve(cnn(), X, MAPS, target)


def test_pixel_removal_target_forms():
    model = cnn()
    predicted = model(X).argmax(1)
    by_class = pixel_removal_curve(model, X, MAPS, predicted, steps=2)
    assert torch.equal(pixel_removal_curve(model, X, MAPS, None, steps=2), by_class)
    assert torch.equal(
        pixel_removal_curve(model, X, MAPS, 3, steps=2),
        pixel_removal_curve(model, X, MAPS, [3, 3, 3, 3], steps=2),
    )


def test_pixel_removal_refuses_a_model_not_returning_scores():
    with raises("one tensor"):
        pixel_removal_curve(lambda x: (cnn()(x),), X, MAPS, T)
    with raises(r"shape \(4, n_outputs\)"):
        pixel_removal_curve(lambda x: cnn()(x)[:, :, None], X, MAPS, T)


@pytest.mark.parametrize(
    ("target", "match"),
    [(T.float(), "integers"), (torch.tensor([1, 2, 3, 40]), r"\[0, 9\]"), (None, "given")],
)
def test_random_logit_targets(target, match):
    with raises(match):
        random_logit_ssim(cnn(), fixed_maps, X, target)


def test_random_logit_accepts_one_int_target_and_checks_it_against_n_classes():
    result = random_logit_ssim(cnn(), fixed_maps, X, 3)
    assert result.ssim.shape == (4,) and np.isfinite(result.ssim).all()
    assert (result.random_targets != 3).all()
    with raises(r"lie in \[0, 3\]"):
        random_logit_ssim(cnn(), fixed_maps, X, T, n_classes=4)
    with raises("n_classes"):
        random_logit_ssim(cnn(), fixed_maps, X, T, n_classes="10")
    one_output = nn.Sequential(nn.Flatten(), nn.Linear(64, 1)).eval()
    with raises("at least two outputs"):
        random_logit_ssim(one_output, fixed_maps, X, 0)


def test_cascading_randomisation_checks_targets_and_layers():
    model = cnn()
    with raises("integers"):
        cascading_randomisation(model, fixed_maps, X, T.float(), ["4"])
    with raises("no layer named 'nope'; layers with parameters: 4, 0"):
        cascading_randomisation(model, fixed_maps, X, T, ["nope"])
    with raises("no parameters"):
        cascading_randomisation(model, fixed_maps, X, T, ["1"])
    steps = cascading_randomisation(model, fixed_maps, X, T, "4")  # one name: a list of one
    assert [s.layers for s in steps] == [("4",)]


# ----------------------------------------------------------------------------- 3. CSC inputs
def test_csc_refuses_non_finite_inputs_also_after_a_valid_call():
    model = cnn()
    nan = X.clone()
    nan[0, 0, 0, 0] = float("nan")
    with raises("NaN"):
        cosine_similarity_convergence(model, nan, "lrp.zplus")
    cosine_similarity_convergence(model, X, "lrp.zplus")
    with raises("NaN"):
        cosine_similarity_convergence(model, nan, "lrp.zplus")


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        (torch.randint(0, 2, (4, 1, 8, 8)), "floating point"),
        (X.half(), "inputs are torch.float16 but the model's parameters are torch.float32"),
        (X[:0], "0 samples"),
        (X[0, 0, 0], "batch axis"),
        (X.numpy(), "torch.Tensor"),
        (torch.empty(4, 1, 8, 8, device="meta"), "meta"),
    ],
)
def test_csc_refuses_bad_inputs(inputs, match):
    with raises(match):
        cosine_similarity_convergence(cnn(), inputs, "lrp.zplus")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_vectors": "5"}, "n_vectors must be an int >= 2"),
        ({"n_vectors": True}, "n_vectors"),
        ({"seed": -1}, "seed"),
        ({"layouts": {"4": (7, 7)}}, r"49 values.*64 values"),
        ({"layouts": {"9": (4, 4, 4)}}, "not compared"),
        ({"layouts": {"4": "4x4"}}, "positive ints"),
        ({"layouts": [(4, 4, 4)]}, "map layer names"),
    ],
)
def test_csc_refuses_bad_options(kwargs, match):
    with raises(match):
        cosine_similarity_convergence(cnn(), X, "lrp.zplus", **kwargs)


def test_csc_layout_that_fits_is_used():
    result = cosine_similarity_convergence(cnn(), X, "gradient", layouts={"4": (4, 4, 4)})
    assert result.cosines["4"].size == 4 * 10 * 16  # samples × vector pairs × locations


# -------------------------------------------------------------------------- 4. silent NaN
def test_map_ssim_refuses_nan_maps():
    with raises("finite"):
        map_ssim(torch.full((2, 8, 8), float("nan")), torch.rand(2, 8, 8))


def test_random_logit_refuses_nan_maps_from_the_maps_function():
    with raises("maps function's result must be finite"):
        random_logit_ssim(cnn(), lambda m, i, t: torch.full((4, 8, 8), float("nan")), X, T)


def test_pixel_removal_refuses_non_finite_inputs_and_removed_value():
    nan = X.clone()
    nan[1, 0, 2, 2] = float("inf")
    with raises("NaN or infinite"):
        pixel_removal_curve(cnn(), nan, MAPS, T)
    with raises("removed_value must be a finite number"):
        pixel_removal_curve(cnn(), X, MAPS, T, removed_value=float("nan"))
    with raises("fraction must be a finite number"):
        removed_pixel_counts(64, "0.5")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"widths": (8, 8), "repeats": 0}, "repeats must be an int >= 1"),
        ({"widths": (1, 1)}, r"widths\[0\] must be an int >= 2"),
        ({"widths": (8, 0, 8)}, r"widths\[1\] must be an int >= 2; got widths\[1\]=0"),
        ({"widths": (8, -3, 8)}, r"widths\[1\]"),
        ({"widths": (8,)}, "at least two ints"),
        ({"widths": 8}, "at least two ints"),
        ({"widths": (8, 8), "beta": float("nan")}, "beta must be a finite number"),
        ({"kind": "bogus"}, "kind must be one of vanilla"),
    ],
)
def test_matrix_chain_refuses_bad_arguments(kwargs, match):
    with raises(match):
        matrix_chain_convergence(**kwargs)


def test_matrix_chain_says_when_a_cosine_is_undefined():
    with pytest.warns(RuntimeWarning, match="undefined at lengths \\[1\\]"):
        curve = matrix_chain_convergence("alpha_beta", (4, 4), alpha=0.0, beta=0.0, repeats=2)
    assert np.isnan(curve.median_cosine).all()
    smallest = matrix_chain_convergence("positive", (2, 2), repeats=1)
    assert np.isfinite(smallest.median_cosine).all()


# ------------------------------------------------------------------ 5. map_ssim shapes
@pytest.mark.parametrize(
    ("first", "second", "match"),
    [
        (torch.rand(4, 8, 8), torch.rand(4, 7, 7), "same shape"),
        (torch.rand(4, 8, 8), torch.rand(3, 8, 8), "same shape"),
        (torch.rand(2, 2, 2), torch.rand(2, 2, 2), "at least 3×3 pixels"),
        (torch.rand(2, 1, 8, 8), torch.rand(2, 1, 8, 8), r"shape \(N, H, W\)"),
        (torch.rand(0, 8, 8), torch.rand(0, 8, 8), "no maps"),
        ([[0.0]], torch.rand(1, 8, 8), "NumPy array"),
    ],
)
def test_map_ssim_refuses_bad_shapes(first, second, match):
    with raises(match):
        map_ssim(first, second)


@pytest.mark.parametrize("size", [3, 4, 5, 6, 7, 9])
def test_map_ssim_window_fits_small_maps(size):
    maps = torch.rand(2, size, size, generator=torch.Generator().manual_seed(size))
    np.testing.assert_allclose(map_ssim(maps, maps), 1.0)
    assert np.isfinite(map_ssim(maps, torch.rand(2, size, size))).all()


# ------------------------------------------------------------- 7. maps function shapes
def test_random_logit_refuses_maps_of_the_wrong_shape():
    with raises(r"must have shape \(4, H, W\); got \(4, 3\)"):
        random_logit_ssim(cnn(), lambda m, i, t: torch.rand(4, 3), X, T)
    with raises("maps must be a method name or a function"):
        random_logit_ssim(cnn(), 3, X, T)  # type: ignore[arg-type]
    with raises(r"\(N, C, H, W\) or \(N, H, W\)"):
        to_maps(torch.rand(4, 64))


# ---------------------------------------------------------------- 8. NumPy in localisation
def test_localisation_score_accepts_numpy_arrays():
    masks = torch.zeros(4, 8, 8, dtype=torch.bool)
    masks[:, :4] = True
    expected = localisation_score(MAPS, masks)
    torch.testing.assert_close(localisation_score(MAPS.numpy(), masks.numpy()), expected)
    torch.testing.assert_close(localisation_score(MAPS.numpy(), masks), expected)
    with raises("masks must be a torch.Tensor or a NumPy array; got list"):
        localisation_score(MAPS, masks.tolist())


# ------------------------------------------- 9. inputs the model cannot run on, inference mode
TWO_CHANNELS = torch.rand(2, 2, 8, 8)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            lambda m: cosine_similarity_convergence(m, TWO_CHANNELS, "gradient"), id="csc"
        ),
        pytest.param(
            lambda m: cosine_similarity_convergence(m, TWO_CHANNELS, "lrp.zplus"), id="csc_lrp"
        ),
        pytest.param(lambda m: pixel_removal_curve(m, TWO_CHANNELS, MAPS[:2], 0), id="pixels"),
        pytest.param(lambda m: random_logit_ssim(m, fixed_maps, TWO_CHANNELS, 1), id="logit"),
    ],
)
def test_inputs_the_model_cannot_run_on_get_explains_message(call):
    model = cnn()
    before = state_fingerprint(model)
    with raises(r"cannot run on inputs of shape \(2, 2, 8, 8\).*1 channels") as caught:
        call(model)
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's error stays chained
    assert_same_state(before, state_fingerprint(model))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: cosine_similarity_convergence(cnn(), X, "gradient"), "cosine_similarity"),
        (lambda: cosine_similarity_convergence(cnn(), X, "lrp.zplus"), "cosine_similarity"),
        (lambda: random_logit_ssim(cnn(), "gradient", X, T), "random_logit_ssim"),
        (lambda: cascading_randomisation(cnn(), "gradient", X, T, "4"), "cascading_random"),
    ],
    ids=["csc", "csc_lrp", "random_logit", "cascading"],
)
def test_gradient_metrics_inside_inference_mode_say_where_to_call_them(call, name):
    with torch.inference_mode(), raises(rf"{name}.*inside torch\.inference_mode\(\).*outside"):
        call()


def test_pixel_removal_needs_no_gradient_and_runs_inside_inference_mode():
    expected = pixel_removal_curve(cnn(), X, MAPS, T, steps=2)
    with torch.inference_mode():  # cnn() built here has inference tensors as parameters
        torch.testing.assert_close(pixel_removal_curve(cnn(), X, MAPS, T, steps=2), expected)


# --------------------------------------------------- 10. method options, layers, n_classes
def explain_maps(steps: int):
    """Maps of integrated gradients with ``steps``, computed without the metrics' helpers."""

    def maps(model, inputs, targets):
        return explain(model, inputs, "integrated_gradients", targets, steps=steps).spatial_map()

    return maps


def test_cascading_randomisation_passes_method_options_like_random_logit():
    model = cnn()
    by_name = cascading_randomisation(model, "integrated_gradients", X, T, ["4", "0"], steps=4)
    by_hand = cascading_randomisation(model, explain_maps(4), X, T, ["4", "0"])
    default = cascading_randomisation(model, explain_maps(20), X, T, ["4", "0"])
    for named, hand, twenty in zip(by_name, by_hand, default, strict=True):
        np.testing.assert_allclose(named.ssim, hand.ssim)
        assert not np.allclose(named.ssim, twenty.ssim)  # steps=4 reached the method
    logit = random_logit_ssim(model, "integrated_gradients", X, T, steps=4)
    np.testing.assert_allclose(logit.ssim, random_logit_ssim(model, explain_maps(4), X, T).ssim)


@pytest.mark.parametrize(
    "call",
    [
        lambda **kw: cascading_randomisation(cnn(), fixed_maps, X, T, "4", **kw),
        lambda **kw: random_logit_ssim(cnn(), fixed_maps, X, T, **kw),
    ],
    ids=["cascading", "random_logit"],
)
def test_options_are_refused_next_to_a_maps_function_and_checked_before_any_work(call):
    with raises(r"options \(steps\) only apply to a method given by name"):
        call(steps=4)


def test_unknown_method_options_are_refused_before_any_work():
    model = Counting().eval()
    with raises("no option 'step'"):
        cascading_randomisation(model, "integrated_gradients", X, T, ["net.4"], step=4)
    with raises("no option 'step'"):
        random_logit_ssim(model, "integrated_gradients", X, T, step=4)
    assert model.calls == 0


def test_cascading_randomisation_refuses_an_empty_layer_list():
    with raises(r"layers is empty; name at least one layer.*\['4', '0'\]"):
        cascading_randomisation(cnn(), fixed_maps, X, T, [])
    with raises("layers is empty"):
        cascading_randomisation(cnn(), "gradient", X, T, ())


def test_random_logit_checks_n_classes_against_the_models_outputs_first():
    with raises(r"n_classes=20 but the model has 10 outputs; give at most n_classes=10"):
        random_logit_ssim(cnn(), "gradient", X, 2, n_classes=20)
    with raises(r"n_classes=11 but the model has 10"):  # targets in range: still refused
        random_logit_ssim(cnn(), fixed_maps, X, 2, n_classes=11)
    result = random_logit_ssim(cnn(), fixed_maps, X, 2, n_classes=10)
    assert ((result.random_targets >= 0) & (result.random_targets < 10)).all()


def test_matrix_chain_accepts_numpy_arrays_and_other_iterables_of_ints():
    expected = matrix_chain_convergence("vanilla", (8, 8, 8), repeats=2)
    for widths in (np.array([8, 8, 8]), np.array([8, 8, 8], dtype=np.int32), iter([8, 8, 8])):
        curve = matrix_chain_convergence("vanilla", widths, repeats=2)
        np.testing.assert_array_equal(curve.median_cosine, expected.median_cosine)
    with raises(r"widths\[1\] must be an int >= 2"):
        matrix_chain_convergence("vanilla", np.array([8, 1, 8]))
    with raises("at least two ints"):
        matrix_chain_convergence("vanilla", np.array(8))
