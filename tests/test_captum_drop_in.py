"""Explainer as a drop-in for Captum: NoiseTunnel, captum.metrics, keywords, targets, deltas.

The references are Captum's own classes on the same weights (and the same random draws), or
values computed by hand.
"""

import pytest
import torch
from captum.attr import (
    LRP,
    DeepLift,
    InputXGradient,
    IntegratedGradients,
    NoiseTunnel,
    Saliency,
)
from captum.metrics import infidelity, sensitivity_max
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import Explainer, InvalidInputError, ModelStateError, explain
from explain_core.plugin_manager import get_registry

# Captum's classes warn that they set requires_grad on the inputs they are given.
pytestmark = pytest.mark.filterwarnings("ignore:Input Tensor 0 did not already require gradients")


def tanh_net():
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()


def relu_net():
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double().eval()


def inputs(batch=3):
    return torch.randn(batch, 5, dtype=torch.float64)


class Gated(nn.Module):
    """A model whose forward takes more than the input: ``f(x, gate, scale)``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x, gate, scale=1.0):
        return self.body(x * gate) * scale


class Baked(nn.Module):
    """``Gated`` with one sample's gate fixed: the reference for that sample."""

    def __init__(self, gated, gate, scale):
        super().__init__()
        self.gated, self.gate, self.scale = gated, gate, scale

    def forward(self, x):
        return self.gated(x, self.gate.expand(x.shape[0], -1), self.scale)


class Grid(nn.Module):
    """Output of shape (batch, 2, 3): Captum addresses it with tuple targets."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 6)

    def forward(self, x):
        return torch.tanh(self.linear(x)).reshape(-1, 2, 3)


# Our method, Captum's class and the keywords that make the two compute the same thing.
PAIRS = {
    "gradient": (Saliency, {"abs": False}, {}),
    "input_x_gradient": (InputXGradient, {}, {}),
    "integrated_gradients": (
        IntegratedGradients,
        {"n_steps": 4, "method": "riemann_middle"},
        {"n_steps": 4, "method": "riemann_middle"},
    ),
}


def test_explainer_has_captums_attribution_interface():
    model = tanh_net()
    explainer = Explainer(model, "integrated_gradients")
    assert explainer.forward_func is model
    assert explainer.has_convergence_delta() and explainer.multiplies_by_inputs
    gradient = Explainer(model, "gradient")
    assert not gradient.has_convergence_delta() and not gradient.multiplies_by_inputs
    assert Explainer(model, "smoothgrad", times_input=True).multiplies_by_inputs
    assert not Explainer(model, "smoothgrad").has_convergence_delta()
    # NoiseTunnel reads both when it is built (this used to fail on has_convergence_delta).
    tunnel = NoiseTunnel(explainer)
    assert tunnel.has_convergence_delta() and tunnel.multiplies_by_inputs
    assert not NoiseTunnel(gradient).has_convergence_delta()


def _declaration_cases():
    options = {
        "lrp.zb": {"low": 0.0, "high": 1.0},
        "lrp.epsilon_gamma_box": {"low": 0.0, "high": 1.0},
    }
    cases = []
    for name, spec in get_registry().items():
        if name.startswith(("coda.", "capsules.", "pattern")) or name == "lrp.custom":
            continue  # these need a model of their own kind, fitted patterns or a composite
        cases.append((name, options.get(name, {})))
        if "times_input" in spec.options():
            cases.append((name, {"times_input": True}))
    return cases


@pytest.mark.parametrize(("method", "options"), _declaration_cases(), ids=repr)
def test_declarations_match_what_the_method_returns(method, options):
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    ).eval()
    x = torch.rand(2, 1, 6, 6)
    x[:, :, :2] = 0  # where input and the zero baseline agree
    explainer = Explainer(model, method, **options)
    result = explainer.explain(x, 1)
    assert explainer.has_convergence_delta() == (result.delta is not None)
    at_zero = result.attribution[:, :, :2]
    # A product with the input (or input − baseline) vanishes there; other maps do not.
    assert explainer.multiplies_by_inputs == bool((at_zero == 0).all())


@pytest.mark.parametrize("nt_type", ["smoothgrad", "smoothgrad_sq", "vargrad"])
@pytest.mark.parametrize("method", sorted(PAIRS))
def test_noise_tunnel_over_our_explainer_equals_captums(method, nt_type):
    model, x = tanh_net(), inputs()
    captum_class, captum_keywords, our_keywords = PAIRS[method]
    # nt_samples_batch_size 2 of 5: two full partitions and a remainder, as Captum splits them.
    common = {
        "nt_type": nt_type,
        "nt_samples": 5,
        "nt_samples_batch_size": 2,
        "stdevs": 0.3,
        "target": [0, 2, 1],
    }
    torch.manual_seed(7)
    ours = NoiseTunnel(Explainer(model, method)).attribute(x, **common, **our_keywords)
    torch.manual_seed(7)
    theirs = NoiseTunnel(captum_class(model)).attribute(x, **common, **captum_keywords)
    assert ours.abs().max() > 0
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def test_noise_tunnel_returns_the_deltas_of_every_noisy_copy():
    model, x = tanh_net(), inputs()
    keywords = {"nt_samples": 3, "stdevs": 0.5, "target": 2, "n_steps": 4}
    torch.manual_seed(3)
    ours, delta = NoiseTunnel(Explainer(model, "integrated_gradients")).attribute(
        x, return_convergence_delta=True, **keywords
    )
    torch.manual_seed(3)
    theirs, captum_delta = NoiseTunnel(IntegratedGradients(model)).attribute(
        x, return_convergence_delta=True, method="riemann_middle", **keywords
    )
    assert delta.shape == (9,) and delta.abs().max() > 1e-4
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(delta, captum_delta)
    with pytest.raises(InvalidInputError, match="defines no convergence delta"):
        NoiseTunnel(Explainer(model, "gradient")).attribute(
            x, nt_samples=2, stdevs=0.1, target=0, return_convergence_delta=True
        )


def test_captum_keywords_map_onto_our_options():
    model, x = tanh_net(), inputs(4)
    explainer = Explainer(model, "integrated_gradients", steps=50)
    by_option = Explainer(model, "integrated_gradients", steps=8).attribute(x, target=1)
    torch.testing.assert_close(explainer.attribute(x, target=1, n_steps=8), by_option)
    # Rows per pass change the batching, not the result.
    torch.testing.assert_close(
        explainer.attribute(x, target=1, n_steps=8, internal_batch_size=3), by_option
    )
    torch.testing.assert_close(
        explainer.attribute(x, target=1, n_steps=8, method="riemann_middle"), by_option
    )
    with pytest.raises(InvalidInputError, match=r"'riemann_middle' rule only.*'gausslegendre'"):
        explainer.attribute(x, target=1, method="gausslegendre")
    with pytest.raises(InvalidInputError, match="integrates no path"):
        Explainer(model, "gradient").attribute(x, target=1, method="riemann_middle")
    with pytest.raises(InvalidInputError, match=r"n_steps= sets the option 'steps'.*'gradient'"):
        Explainer(model, "gradient").attribute(x, target=1, n_steps=4)
    with pytest.raises(InvalidInputError, match="internal_batch_size"):
        Explainer(model, "gradient").attribute(x, target=1, internal_batch_size=4)
    with pytest.raises(InvalidInputError, match=r"'steps'.*must be an integer"):
        explainer.attribute(x, target=1, n_steps=2.5)


@pytest.mark.parametrize(
    "baselines",
    [0.5, torch.full((1, 5), 0.5, dtype=torch.float64), "per-sample", "tuple"],
    ids=["number", "one-row", "per-sample", "tuple"],
)
def test_baselines_in_captums_forms(baselines):
    model, x = tanh_net(), inputs()
    if baselines == "per-sample":
        baselines = torch.randn(3, 5, dtype=torch.float64)
    elif baselines == "tuple":
        baselines = (torch.randn(3, 5, dtype=torch.float64),)
    keywords = {"target": 1, "baselines": baselines, "n_steps": 4}
    ours = Explainer(model, "integrated_gradients").attribute(x, **keywords)
    theirs = IntegratedGradients(model).attribute(x, method="riemann_middle", **keywords)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(
    "target",
    [2, [0, 2, 1], torch.tensor([1, 0, 2]), torch.tensor(2), torch.tensor([1])],
    ids=["int", "list", "tensor", "0-d tensor", "1-element tensor"],
)
def test_target_forms_of_2d_outputs(target):
    model, x = tanh_net(), inputs()
    ours = Explainer(model, "gradient").attribute(x, target=target)
    theirs = Saliency(model).attribute(x, target=target, abs=False)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(
    "target", [(1, 2), (0, -1), [(0, 1), (1, 2), (1, 0)]], ids=["tuple", "negative", "per sample"]
)
def test_tuple_targets_address_outputs_with_more_axes(target):
    model, x = Grid().double().eval(), inputs()
    before = state_fingerprint(model)
    for method, captum_class, keywords in [
        ("gradient", Saliency, {"abs": False}),
        ("input_x_gradient", InputXGradient, {}),
    ]:
        ours = Explainer(model, method).attribute(x, target=target)
        theirs = captum_class(model).attribute(x, target=target, **keywords)
        assert ours.abs().max() > 0
        torch.testing.assert_close(ours, theirs)
    assert_same_state(before, state_fingerprint(model))


@pytest.mark.parametrize(
    ("target", "phrase"),
    [
        ((1,), r"one integer per output axis.*\(batch, 2, 3\), got \(1,\)"),
        ((2, 0), r"outside the model's output of shape \(batch, 2, 3\)"),
        ((0, slice(None)), "one integer per output axis"),
        ([(0, 1), 1, (1, 1)], "mixes tuples"),
        ([(0, 1)], r"one tuple per sample \(3\); got 1"),
    ],
    ids=["short", "out of range", "slice", "mixed", "count"],
)
def test_bad_tuple_targets_are_refused(target, phrase):
    with pytest.raises(InvalidInputError, match=phrase):
        Explainer(Grid().double().eval(), "gradient").attribute(inputs(), target=target)


def test_tuple_target_of_a_2d_output_model_is_its_column():
    model, x = tanh_net(), inputs()
    explainer = Explainer(model, "gradient")
    torch.testing.assert_close(explainer.attribute(x, target=(2,)), explainer.attribute(x, 2))
    with pytest.raises(ModelStateError, match="training mode"):
        Explainer(nn.Sequential(nn.Linear(5, 3), nn.Dropout()).train(), "gradient").attribute(
            x.float(), target=(1,)
        )


@pytest.mark.parametrize("method", ["integrated_gradients", "deeplift.rescale", "lrp.epsilon"])
def test_additional_forward_args_follow_every_copy_of_their_sample(method):
    model, x = Gated().double().eval(), inputs(4)
    gate = (torch.rand(4, 5) > 0.3).double()
    gate[3] = gate[1]  # two samples share their gate: one group
    before = state_fingerprint(model)
    ours, delta = Explainer(model, method).attribute(
        x, target=[0, 1, 2, 0], additional_forward_args=(gate, 2.0), return_convergence_delta=True
    )
    assert_same_state(before, state_fingerprint(model))
    # Reference: each sample on a model with its gate built in (the methods feed the model
    # path points, or a reference input concatenated to the batch).
    for i, label in enumerate([0, 1, 2, 0]):
        alone = explain(Baked(model, gate[i : i + 1], 2.0).eval(), x[i : i + 1], method, label)
        torch.testing.assert_close(ours[i : i + 1], alone.attribution)
        torch.testing.assert_close(delta[i : i + 1], -alone.delta)
    assert (ours[gate == 0] == 0).all() and ours.abs().max() > 0


def test_additional_forward_args_as_captum_passes_them():
    model, x = Gated().double().eval(), inputs(3)
    gate = (torch.rand(3, 5) > 0.3).double()
    keywords = {"target": [2, 0, 1], "additional_forward_args": (gate, 3.0), "n_steps": 4}
    ours, delta = Explainer(model, "integrated_gradients").attribute(
        x, return_convergence_delta=True, **keywords
    )
    theirs, captum_delta = IntegratedGradients(model).attribute(
        x, return_convergence_delta=True, method="riemann_middle", **keywords
    )
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(delta, captum_delta)
    # One argument that is no tuple is one argument, as in Captum.
    torch.testing.assert_close(
        Explainer(model, "gradient").attribute(x, target=1, additional_forward_args=gate),
        Saliency(model).attribute(x, target=1, additional_forward_args=gate, abs=False),
    )
    torch.manual_seed(5)
    ours = NoiseTunnel(Explainer(model, "input_x_gradient")).attribute(
        x, nt_samples=3, stdevs=0.2, target=1, additional_forward_args=(gate, 3.0)
    )
    torch.manual_seed(5)
    theirs = NoiseTunnel(InputXGradient(model)).attribute(
        x, nt_samples=3, stdevs=0.2, target=1, additional_forward_args=(gate, 3.0)
    )
    torch.testing.assert_close(ours, theirs)


def test_samples_sharing_their_forward_args_are_explained_in_one_call():
    model, x = Gated().double().eval(), inputs(4)
    calls = []
    model.body.register_forward_pre_hook(lambda module, args: calls.append(len(args[0])))
    shared = torch.ones(1, 5, dtype=torch.float64).expand(4, 5)
    Explainer(model, "integrated_gradients", steps=4).attribute(
        x, target=1, additional_forward_args=(shared, 1.0)
    )
    # One call of explain(): the outputs at the inputs and at the baseline, then 4 path points
    # of 4 samples in one pass.
    assert calls == [4, 4, 16]
    calls.clear()
    apart = torch.eye(4, 5, dtype=torch.float64) + 1  # every sample its own row
    Explainer(model, "integrated_gradients", steps=4).attribute(
        x, target=1, additional_forward_args=(apart, 1.0)
    )
    assert calls == [1, 1, 4] * 4


def test_bad_additional_forward_args_are_refused():
    x = inputs(3)
    with pytest.raises(InvalidInputError, match=r"forward\(input\) cannot take.*1 additional"):
        Explainer(tanh_net(), "gradient").attribute(x, target=0, additional_forward_args=(1.0,))
    with pytest.raises(InvalidInputError, match=r"\[0\] has shape \(2, 5\).*one row per sample"):
        Explainer(Gated().double().eval(), "gradient").attribute(
            x, target=0, additional_forward_args=torch.ones(2, 5, dtype=torch.float64)
        )


@pytest.mark.parametrize("method", ["integrated_gradients", "deeplift.rescale"])
def test_delta_has_the_sign_of_captums_compute_convergence_delta(method):
    model, x = relu_net(), 3 * inputs(4)
    baselines = torch.full((1, 5), 0.2, dtype=torch.float64)
    captum_class = IntegratedGradients if method == "integrated_gradients" else DeepLift
    options = {"steps": 3} if method == "integrated_gradients" else {}
    ours, delta = Explainer(model, method, **options).attribute(
        x, target=2, baselines=baselines, return_convergence_delta=True
    )
    # Captum's own check on our attribution: Σ attribution − (f(x) − f(baselines)).
    captum_delta = captum_class(model).compute_convergence_delta(ours, baselines, x, target=2)
    if method == "integrated_gradients":
        assert delta.abs().max() > 1e-3  # three steps leave a delta whose sign matters
    torch.testing.assert_close(delta, captum_delta)


def test_lrp_delta_is_opposite_to_captums_lrp():
    model, x = relu_net(), inputs(4)
    ours, delta = Explainer(model, "lrp.epsilon", epsilon=0.5).attribute(
        x, target=1, return_convergence_delta=True
    )
    assert delta.abs().max() > 1e-3  # ε absorbs relevance
    # Captum's LRP reports output − Σ relevance; the Explainer keeps one sign for every method.
    captum_delta = LRP(model).compute_convergence_delta(ours, model(x)[:, 1].detach())
    torch.testing.assert_close(delta, -captum_delta)


def test_captum_sensitivity_max_calls_our_explainer():
    model, x = tanh_net(), inputs()
    torch.manual_seed(2)
    ours = sensitivity_max(
        Explainer(model, "gradient").attribute, x, target=[0, 1, 2], n_perturb_samples=4
    )
    torch.manual_seed(2)
    theirs = sensitivity_max(
        Saliency(model).attribute, x, target=[0, 1, 2], n_perturb_samples=4, abs=False
    )
    assert ours.min() > 0
    torch.testing.assert_close(ours, theirs)


def test_captum_infidelity_of_our_attribution_by_hand():
    x = inputs()
    shift = torch.full_like(x, 0.1)

    def perturb(batch):
        return shift.repeat(batch.shape[0] // x.shape[0], 1), batch - 0.1

    # The gradient of a linear model predicts every output change exactly: no infidelity.
    linear = nn.Linear(5, 3).double().eval()
    attribution = Explainer(linear, "gradient").attribute(x, target=1)
    exact = infidelity(linear, perturb, x, attribution, target=1, n_perturb_samples=2)
    torch.testing.assert_close(exact, torch.zeros(3, dtype=torch.float64))
    model = tanh_net()
    attribution = Explainer(model, "gradient").attribute(x, target=1)
    score = infidelity(model, perturb, x, attribution, target=1, n_perturb_samples=2)
    with torch.no_grad():
        change = model(x)[:, 1] - model(x - 0.1)[:, 1]
    by_hand = ((attribution * shift).sum(1) - change) ** 2
    assert by_hand.min() > 0
    torch.testing.assert_close(score, by_hand)


def test_a_tuple_target_with_contrastive_lrp_is_refused_with_the_wrapper_to_write():
    # it contrasted the entry with every other entry of the output map, where the pixel wrapper
    # contrasts it with the other classes there: maps 10 times apart
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 6), nn.Unflatten(1, (2, 3)))
    x = torch.rand(4, 5)
    with pytest.raises(InvalidInputError, match=r"return model\(x\)\[:, :, i, j\]"):
        Explainer(model.eval(), "lrp.contrastive").attribute(x, target=(1, 2))
    # methods that explain the entry alone take the tuple target as the wrapper's
    wrapper = nn.Sequential(model, nn.Flatten())  # entry (1, 2) is output 5
    torch.testing.assert_close(
        Explainer(model, "lrp.zplus").attribute(x, target=(1, 2)),
        explain(wrapper, x, "lrp.zplus", 5).attribution,
    )


@pytest.mark.parametrize("form", ["ndarray", "nested list", "1-tuple of an ndarray"])
def test_per_sample_baselines_not_given_as_a_tensor_follow_their_samples(form):
    # with a forward argument the batch is explained in groups: only a tensor's rows were picked,
    # and an array of 3 rows met a group of 2
    model, x = Gated().double().eval(), inputs(3)
    gate = torch.tensor([[1.0] * 5, [1.0] * 5, [0.0, 1, 1, 1, 1]], dtype=torch.float64)
    reference = torch.randn(3, 5, dtype=torch.float64)
    given = {
        "ndarray": reference.numpy(),
        "nested list": reference.tolist(),
        "1-tuple of an ndarray": (reference.numpy(),),
    }[form]
    explainer = Explainer(model, "integrated_gradients")
    keywords = {"target": 1, "additional_forward_args": (gate, 2.0)}
    expected = explainer.attribute(x, baselines=reference, **keywords)
    torch.testing.assert_close(explainer.attribute(x, baselines=given, **keywords), expected)


def test_captum_positional_baselines_are_refused_not_read_as_a_target():
    # IntegratedGradients.attribute(x, baselines, target): attribute(x, 0, 2) explained class 0
    model, x = relu_net(), inputs()
    explainer = Explainer(model, "integrated_gradients")
    with pytest.raises(InvalidInputError, match=r"by keyword.*target=\.\.\., baselines=\.\.\."):
        explainer.attribute(x, 0, 2)
    with pytest.raises(InvalidInputError, match=r"floating point values.*baselines second"):
        explainer.attribute(x, 0.5)
    with pytest.raises(InvalidInputError, match=r"floating point values.*baselines second"):
        explainer.attribute(x, torch.zeros_like(x))  # a baseline tensor second
    with pytest.raises(InvalidInputError, match=r"after the inputs and target= as well"):
        explainer.attribute(x, torch.zeros_like(x), target=2)  # Python's TypeError before
    ours = explainer.attribute(x, 2, baselines=0.0, n_steps=8)  # the target second: Saliency's
    theirs = IntegratedGradients(model).attribute(x, 0.0, 2, n_steps=8, method="riemann_middle")
    torch.testing.assert_close(ours, theirs)


def test_a_function_as_the_model_gets_the_clear_error_with_forward_arguments_too():
    # ForwardWithArgs raised "'function' object has no attribute 'training'"
    def forward(x, scale):
        return relu_net()(x) * scale

    for keywords in ({}, {"additional_forward_args": 2.0}):
        with pytest.raises(InvalidInputError, match=r"model must be a torch\.nn\.Module"):
            Explainer(forward, "gradient").attribute(inputs(), target=1, **keywords)
