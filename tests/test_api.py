from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import (
    Attribution,
    Explainer,
    InvalidInputError,
    ModelGuard,
    ModelStateError,
    UnknownMethodError,
    UnsupportedModelError,
    explain,
    quantus_explain,
)


class Quadratic(nn.Module):
    """f_k(x) = k-th scaled sum of squares: gradients known in closed form."""

    def forward(self, x):
        s = (x**2).flatten(1).sum(1, keepdim=True)
        return torch.cat([s, 2 * s, -s], dim=1)


def linear_model():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).double().eval()
    return model


def test_gradient_and_input_x_gradient_match_the_weights_of_a_linear_model():
    model = linear_model()
    x = torch.randn(3, 1, 3, 4, dtype=torch.float64)
    target = torch.tensor([0, 3, 2])
    weight = model[1].weight[target].reshape(3, 1, 3, 4)
    grad = explain(model, x, "gradient", target)
    assert isinstance(grad, Attribution) and grad.method == "gradient" and grad.delta is None
    torch.testing.assert_close(grad.attribution, weight)
    ixg = explain(model, x, "input_x_gradient", target)
    torch.testing.assert_close(ixg.attribution, x * weight)
    torch.testing.assert_close(ixg.delta, model[1].bias[target].detach())  # the bias is unexplained
    torch.testing.assert_close(ixg.output, model(x).detach())
    assert torch.equal(ixg.target, target)


def test_integrated_gradients_is_exact_for_quadratics_and_converges():
    model = Quadratic().double()
    x = torch.randn(2, 5, dtype=torch.float64)
    result = explain(model, x, "integrated_gradients", target=1, steps=3, internal_batch_size=2)
    torch.testing.assert_close(result.attribution, 2 * x**2)  # ∫ 2·2αx dα · x = 2x²
    assert result.delta.abs().max() < 1e-12
    baseline = torch.full_like(x, 0.5)
    shifted = explain(model, x, "integrated_gradients", target=0, baselines=baseline, steps=4)
    torch.testing.assert_close(shifted.attribution, x**2 - 0.25)
    torch.testing.assert_close(shifted.extras["baselines"], baseline)


def test_integrated_gradients_delta_shrinks_with_steps_on_a_nonlinear_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64) * 3
    coarse = explain(model, x, "integrated_gradients", target=0, steps=2).delta.abs().max()
    fine = explain(model, x, "integrated_gradients", target=0, steps=64).delta.abs().max()
    assert fine < coarse / 50


def test_predicted_class_is_the_default_target():
    model = linear_model()
    x = torch.randn(4, 1, 3, 4, dtype=torch.float64)
    result = explain(model, x, "gradient")
    assert torch.equal(result.target, model(x).argmax(1))
    single = explain(model, x, "gradient", target=2)
    assert torch.equal(single.target, torch.full((4,), 2))
    listed = explain(model, x, "gradient", target=[0, 1, 2, 3])
    assert torch.equal(listed.target, torch.arange(4))
    assert torch.equal(single.target_output, model(x)[:, 2].detach())


def test_spatial_map_sums_channels():
    model = nn.Sequential(nn.Flatten(), nn.Linear(2 * 3 * 3, 2)).eval()
    x = torch.randn(2, 2, 3, 3)
    result = explain(model, x, "input_x_gradient")
    torch.testing.assert_close(result.spatial_map(), result.attribution.sum(1))
    flat = explain(nn.Linear(3, 2).eval(), torch.randn(2, 3), "gradient")
    with pytest.raises(ValueError, match=r"\(batch, C, H, W\)"):
        flat.spatial_map()


def test_captum_style_explainer():
    model = linear_model()
    x = torch.randn(2, 1, 3, 4, dtype=torch.float64)
    explainer = Explainer(model, "integrated_gradients", steps=8)
    attribution = explainer.attribute(x, target=1)
    torch.testing.assert_close(attribution, x * model[1].weight[1].reshape(1, 3, 4))
    (as_tuple,) = explainer.attribute((x,), target=1, baselines=(torch.zeros_like(x),))
    torch.testing.assert_close(as_tuple, attribution)
    attribution, delta = explainer.attribute(x, target=1, return_convergence_delta=True)
    assert delta.shape == (2,) and delta.abs().max() < 1e-10
    with pytest.raises(InvalidInputError, match="no convergence delta"):
        Explainer(model, "gradient").attribute(x, target=0, return_convergence_delta=True)
    # Passed to the model's forward after the input: this one takes none.
    with pytest.raises(InvalidInputError, match=r"forward\(input\) cannot take the input and 1"):
        explainer.attribute(x, target=0, additional_forward_args=(1,))
    with pytest.raises(UnknownMethodError):
        Explainer(model, "integrated_gradient")
    with pytest.raises(InvalidInputError, match="no option 'step'"):
        Explainer(model, "integrated_gradients", step=8)


def test_explainer_convergence_delta_has_captums_sign():
    from captum.attr import IntegratedGradients

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    x = 3 * torch.randn(4, 5, dtype=torch.float64)
    ours, delta = Explainer(model, "integrated_gradients", steps=4).attribute(
        x, target=0, return_convergence_delta=True
    )
    # Captum's midpoint rule samples the path where ours does: the same attribution, and its
    # delta Σ attribution − (f(x) − f(0)).
    theirs, captum_delta = IntegratedGradients(model).attribute(
        x, target=0, n_steps=4, method="riemann_middle", return_convergence_delta=True
    )
    torch.testing.assert_close(ours, theirs)
    gain = model(x)[:, 0] - model(torch.zeros_like(x))[:, 0]
    by_hand = ours.sum(1) - gain.detach()
    assert by_hand.abs().max() > 1e-3  # four steps leave a delta whose sign matters
    torch.testing.assert_close(captum_delta, by_hand)
    torch.testing.assert_close(delta, by_hand)
    # explain() keeps its documented sign: the output gain the attribution leaves unexplained.
    torch.testing.assert_close(
        explain(model, x, "integrated_gradients", 0, steps=4).delta, -by_hand
    )


def test_quantus_style_function_takes_and_returns_numpy():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).eval()
    x = np.random.default_rng(0).normal(size=(3, 1, 3, 4)).astype(np.float32)
    y = np.array([0, 1, 2])
    result = quantus_explain(model, x, y, method="gradient")
    assert isinstance(result, np.ndarray) and result.shape == x.shape
    np.testing.assert_allclose(result[1], model[1].weight[1].detach().reshape(1, 3, 4).numpy())


@pytest.mark.parametrize("given", [np.float32, np.float64])
def test_quantus_function_converts_inputs_to_the_models_dtype(given):
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).double().eval()
    x = np.random.default_rng(0).normal(size=(3, 1, 3, 4)).astype(given)
    result = quantus_explain(model, x, np.array([0, 1, 2]), method="gradient")
    assert result.dtype == np.float64  # float32 inputs used to be refused for this model
    expected = model[1].weight.detach()[[0, 1, 2]].reshape(3, 1, 3, 4).numpy()
    np.testing.assert_allclose(result, expected)
    # A model without parameters has no dtype to follow: float32, as before.
    assert quantus_explain(Quadratic().eval(), x, 0, method="gradient").dtype == np.float32


@pytest.mark.parametrize(
    "method", ["gradient", "input_x_gradient", "integrated_gradients", "dynamic.contributions"]
)
def test_model_is_left_exactly_as_it_was(method):
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.BatchNorm2d(3),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(3 * 4 * 4, 4),
    ).eval()
    model.user_note = {"owner": "me"}
    handle = model[0].register_forward_hook(lambda *args: None)
    x = torch.rand(2, 1, 6, 6)
    before, out = state_fingerprint(model), model(x).detach()
    explain(model, x, method)
    assert_same_state(before, state_fingerprint(model))
    assert torch.equal(model(x), out)
    handle.remove()


class _SideEffects(nn.Module):
    """A forward with side effects on itself: a hook and an attribute, then an error."""

    def __init__(self, fail: bool):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.fail = fail

    def forward(self, x):
        self.linear.register_forward_hook(lambda *a: None)  # misbehaving code inside
        self.scratch = 1
        if self.fail:
            raise RuntimeError("forward failed")
        return self.linear(x)


@pytest.mark.parametrize("fail", [False, True])
def test_a_builtin_method_leaves_the_model_as_a_plain_forward_leaves_it(fail):
    # Built-in methods never write to the model (so other threads can use it meanwhile): what
    # the model's own forward does to itself stays, exactly as after a plain forward pass.
    model = _SideEffects(fail).eval()
    weight = model.linear.weight.detach().clone()
    with pytest.raises(RuntimeError, match="forward failed") if fail else nullcontext():
        explain(model, torch.randn(1, 3), "gradient")
    # exactly the forward's own hooks and attribute, nothing of the attribution's (after a
    # failure explain() runs the model once more, to name the cause)
    assert len(model.linear._forward_hooks) == (2 if fail else 1)
    assert all(
        not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks)
        for m in (model, model.linear)
        if m is not model.linear
    )
    assert model.scratch == 1
    assert set(model.__dict__) == set(_SideEffects(fail).__dict__) | {"scratch"}
    assert torch.equal(model.linear.weight, weight) and model.linear.weight.grad is None


def test_model_guard_restores_structure_buffers_and_refuses_parameter_edits():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).eval()
    before = state_fingerprint(model)
    linear, bn = model[0], model[1]
    with ModelGuard(model, restore=True):
        linear.weight = nn.Parameter(torch.zeros(2, 2))
        bn.running_mean.add_(5.0)
        model[1] = nn.Identity()
        model.train()
        model.extra = 3
    assert_same_state(before, state_fingerprint(model))
    assert model[1] is bn
    with pytest.raises(ModelStateError, match=r"0\.bias"), ModelGuard(model):
        linear.bias.data = torch.zeros(3)  # another storage through .data: put back, reported
    assert_same_state(before, state_fingerprint(model))
    weight = linear.weight.detach().clone()
    with (
        pytest.raises(ModelStateError, match=r"forward modified its parameter\(s\) 0\.weight"),
        ModelGuard(model),
        torch.no_grad(),
    ):
        linear.weight.mul_(2)  # moves the version counter
    torch.testing.assert_close(linear.weight, 2 * weight)  # reported, not undone (no copy kept)
    with pytest.raises(ModelStateError, match=r"0\.bias"), ModelGuard(model):
        linear.bias.data.add_(1.0)  # invisible to the version counter, not to the checksum


@pytest.mark.parametrize("edited", ["0.weight", "1.bias", "2.weight"])
def test_the_checksums_name_the_parameter_edited_in_a_model_of_several_dtypes(edited):
    # The checksums are summed per dtype (and device) and brought to the CPU at once: an edit
    # through .data must still be pinned on its own parameter.
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).double(), nn.Linear(3, 3).half())
    parameter = dict(model.named_parameters())[edited]
    guard = ModelGuard(model)
    with pytest.raises(ModelStateError, match=edited.replace(".", r"\.")), guard:
        parameter.data[0] += 1.0
    assert guard.changed_parameters == [edited]


def test_bad_input_gets_clear_errors():
    model = linear_model()
    x = torch.randn(2, 1, 3, 4, dtype=torch.float64)
    with pytest.raises(UnknownMethodError, match="did you mean 'gradient'"):
        explain(model, x, "gradiant")
    with pytest.raises(InvalidInputError, match="registered name"):
        explain(model, x, torch.tensor([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="batch axis"):
        explain(model, x[0, 0, 0], "gradient")
    with pytest.raises(InvalidInputError, match=r"floating point.*Token ids.*embedding's output"):
        explain(model, x.long(), "gradient")
    with pytest.raises(InvalidInputError, match=r"floating point; got dtype torch\.bool\. Use"):
        explain(model, x > 0, "gradient")
    with pytest.raises(InvalidInputError, match="NaN"):
        explain(model, x.clone().fill_(float("nan")), "gradient")
    with pytest.raises(InvalidInputError, match=r"torch\.Tensor"):
        explain(model, x.numpy(), "gradient")
    with pytest.raises(InvalidInputError, match=r"\[0, 3\]"):
        explain(model, x, "gradient", target=4)
    with pytest.raises(InvalidInputError, match="one int per sample"):
        explain(model, x, "gradient", target=[0, 1, 2])
    with pytest.raises(InvalidInputError, match="integers"):
        explain(model, x, "gradient", target=torch.tensor([0.5, 1.0]))
    with pytest.raises(InvalidInputError, match="takes no baselines"):
        explain(model, x, "gradient", baselines=torch.zeros_like(x))
    with pytest.raises(InvalidInputError, match="do not broadcast"):
        explain(model, x, "integrated_gradients", baselines=torch.zeros(5))
    with pytest.raises(InvalidInputError, match="steps"):
        explain(model, x, "integrated_gradients", steps=0)
    with pytest.raises(InvalidInputError, match=r"shape \(batch, n_outputs\)"):
        explain(nn.Flatten(0).eval(), x, "gradient")
    explain(linear_model().train(), x, "gradient")  # nothing mode-dependent: allowed
    with_dropout = nn.Sequential(nn.Flatten(), nn.Dropout(), nn.Linear(12, 4)).double()
    with pytest.raises(ModelStateError, match=r"Dropout '1' is in training mode.*model.eval\(\)"):
        explain(with_dropout, x, "gradient")


class FunctionalTraining(nn.Module):
    """Dropout and batch norm as calls that follow ``self.training`` (no such modules)."""

    def __init__(self, call: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.call = nn.Linear(5, 8), nn.Linear(8, 3), call
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        if self.call == "dropout":
            h = torch.nn.functional.dropout(h, 0.5, self.training)
        else:
            h = torch.nn.functional.batch_norm(
                h, self.mean.clone(), self.var.clone(), None, None, self.training
            )
        return self.b(h)


@pytest.mark.parametrize("call", ["dropout", "batch_norm"])
def test_calls_that_follow_training_mode_are_refused(call):
    """Issue 22: F.dropout(h, p, self.training) gave another map on every call, unwarned."""
    model, x = FunctionalTraining(call), torch.randn(4, 5)
    with pytest.raises(ModelStateError, match=rf"calls {call} in training mode.*model\.eval\(\)"):
        explain(model, x, "gradient", 0)
    explain(model, x, "gradient", 0, allow_training=True)  # the user asked for it
    first = explain(model.eval(), x, "gradient", 0).attribution  # eval: deterministic
    torch.testing.assert_close(explain(model, x, "gradient", 0).attribution, first)


def test_batchnorm_without_running_statistics_is_not_told_to_call_eval():
    # nn.BatchNorm2d(track_running_stats=False) uses the batch's statistics in eval mode too:
    # the refusal said "call model.eval()" to a model already in eval mode
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 3)
    ).eval()
    x = torch.randn(4, 5)
    with pytest.raises(ModelStateError) as error:
        explain(model, x, "gradient", 0)
    assert "track_running_stats=False" in str(error.value)
    assert "model.eval()" not in str(error.value)
    explain(model, x, "gradient", 0, allow_training=True)  # the user asked for it


class StdConv2d(nn.Conv2d):
    """timm's weight-standardised convolution (ResNetV2-BiT, NFNets), as timm writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None,
            training=True, momentum=0.0, eps=1e-6,
        ).reshape_as(self.weight)  # fmt: skip
        return F.conv2d(x, weight, self.bias, self.stride, self.padding)


def test_batch_norm_of_a_weight_is_not_taken_for_batch_statistics():
    # F.batch_norm(weight, None, None, training=True) standardises a weight, the same for every
    # sample: every method, the gradient too, refused timm's ResNetV2 and NFNets as batch-dependent
    torch.manual_seed(0)
    model = nn.Sequential(
        StdConv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4, 3),
    ).eval()  # fmt: skip
    x = torch.rand(2, 3, 8, 8)
    inputs = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(model(inputs)[:, 1].sum(), inputs)
    torch.testing.assert_close(explain(model, x, "gradient", 1).attribution, expected)
    # the affine rules cannot recompute it from its parameters: one clear refusal, by name
    with pytest.raises(UnsupportedModelError, match=r"module '0' \(StdConv2d\) does not compute"):
        explain(model, x, "lrp.epsilon", 1)


class FractionalPooling(nn.Module):
    def __init__(self, windows: torch.Tensor | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(3 * 16, 2)
        self.pool = nn.FractionalMaxPool2d(2, output_size=4, _random_samples=windows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.conv(x).relu()).flatten(1))


def test_fractional_max_pooling_with_random_windows_is_refused_also_in_eval_mode():
    # it draws new windows on every call in eval mode too: two gradients of one input differed
    x = torch.randn(3, 2, 8, 8)
    with pytest.raises(ModelStateError, match=r"fractional_max_pool2d, which draws its pooling"):
        explain(FractionalPooling().eval(), x, "gradient", 0)
    with_indices = FractionalPooling().eval()
    with_indices.pool.return_indices = True
    with_indices.forward = lambda x: with_indices.head(  # type: ignore[method-assign]
        with_indices.pool(with_indices.conv(x).relu())[0].flatten(1)
    )
    with pytest.raises(ModelStateError, match=r"fractional_max_pool2d_with_indices, which draws"):
        explain(with_indices, x, "gradient", 0)
    explain(FractionalPooling().eval(), x, "gradient", 0, allow_training=True)  # asked for
    fixed = FractionalPooling(torch.rand(3, 3, 2)).eval()
    first = explain(fixed, x, "gradient", 0).attribution
    torch.testing.assert_close(explain(fixed, x, "gradient", 0).attribution, first)


def test_attention_dropout_in_training_mode_is_refused():
    attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention, self.head = attention, nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))

    model, x = Attend(), torch.randn(2, 4, 8)
    with pytest.raises(ModelStateError, match=r"dropout with p=0\.5"):
        explain(model, x, "gradient", 0)
    explain(model.eval(), x, "gradient", 0)
