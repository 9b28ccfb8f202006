"""Element-wise activations other than ReLU: LRP's pass rule and DeepLIFT's multipliers.

References: LRP-ε written out by hand for a one-hidden-layer net (relevance passed through the
activation unchanged), LRP-0 = Input×Gradient for positively homogeneous activations, Captum's
DeepLift for the activations it supports, and DeepLIFT's summation-to-delta.
"""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from explain_core import ModelStateError, UnsupportedModelError, explain

ACTIVATIONS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "elu": nn.ELU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "softplus": nn.Softplus,
    "mish": nn.Mish,
    "hardtanh": nn.Hardtanh,
    "hardswish": nn.Hardswish,  # MobileNetV3
    "hardsigmoid": nn.Hardsigmoid,
    "prelu": lambda: nn.PReLU(init=0.3),  # a learned slope (a parameter of the module)
    "rrelu": nn.RReLU,  # in eval, a leaky ReLU of slope (lower + upper) / 2
}


def mlp(activation: nn.Module, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Linear(5, 7, bias=bias), activation, nn.Linear(7, 3, bias=bias))
        .double()
        .eval()
    )


def cnn(activation: Callable[[], nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            activation(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 4, 3, padding=1),
            activation(),
            nn.Flatten(),
            nn.Linear(4 * 3 * 3, 3),
        )
        .double()
        .eval()
    )


def lrp_epsilon_by_hand(model: nn.Sequential, x: torch.Tensor, target: int, eps: float):
    """``R_i = Σ_j x_i w_ji / (z_j + ε·sign z_j) · R_j`` per Linear; the activation passes R."""
    first, activation, second = model
    z1 = first(x)
    a1 = activation(z1)
    z2 = second(a1)

    def stabilised(z):
        return torch.where(z >= 0, z + eps, z - eps)

    relevance_out = torch.zeros_like(z2)
    relevance_out[:, target] = z2[:, target]
    relevance_a1 = a1 * ((relevance_out / stabilised(z2)) @ second.weight)
    relevance_z1 = relevance_a1  # the pass rule
    return x * ((relevance_z1 / stabilised(z1)) @ first.weight)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_lrp_epsilon_passes_relevance_through_the_activation(name):
    model = mlp(ACTIVATIONS[name]())
    x = torch.randn(6, 5, dtype=torch.float64)
    got = explain(model, x, "lrp.epsilon", 2, epsilon=0.01).attribution
    expected = lrp_epsilon_by_hand(model, x, 2, 0.01)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["tanh", "gelu", "silu", "elu", "softplus", "hardswish", "prelu"])
def test_lrp_zero_conserves_relevance_on_bias_free_nets(name):
    # the gradient (f'(z) instead of f(z)/z) would not conserve it for these activations
    model = mlp(ACTIVATIONS[name](), bias=False)
    x = torch.randn(6, 5, dtype=torch.float64)
    result = explain(model, x, "lrp.z", 0)
    zeros = torch.zeros(6, dtype=torch.float64)
    torch.testing.assert_close(result.delta, zeros, atol=1e-10, rtol=0)


def test_lrp_zero_is_input_times_gradient_for_leaky_relu():
    model = cnn(lambda: nn.LeakyReLU(0.2))
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(
        explain(model, x, "lrp.z", 1).attribution,
        explain(model, x, "input_x_gradient", 1).attribution,
    )


@pytest.mark.parametrize("name", ["relu", "tanh", "sigmoid", "elu", "leaky_relu", "softplus"])
def test_deeplift_rescale_equals_captum_on_the_activations_captum_supports(name):
    captum_attr = pytest.importorskip("captum.attr")

    model = cnn(ACTIVATIONS[name])
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    reference = torch.randn(1, 2, 6, 6, dtype=torch.float64).expand_as(x)
    # the net max-pools: Captum 0.9's result there is the gradient's (its max-pool rule's
    # multipliers do not reach the inputs), so compare with maxpool="gradient"
    ours = explain(model, x, "deeplift.rescale", 1, baselines=reference, maxpool="gradient")
    captum = captum_attr.DeepLift(cnn(ACTIVATIONS[name])).attribute(x, reference, target=1)
    torch.testing.assert_close(ours.attribution, captum, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["deeplift.rescale", "deeplift.reveal_cancel"])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_deeplift_sums_to_the_output_difference(method, name):
    model = cnn(ACTIVATIONS[name])
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    reference = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    result = explain(model, x, method, 0, baselines=reference)
    with torch.no_grad():
        difference = model(x)[:, 0] - model(reference)[:, 0]
    torch.testing.assert_close(result.attribution.sum((1, 2, 3)), difference)


class GlobalMax(nn.Module):
    """A ReLU net whose features are max-pooled over the whole image, written in ``form``."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)
        self.pool = nn.MaxPool2d(6, return_indices=form == "MaxPool2d(return_indices)")
        self.adaptive = nn.AdaptiveMaxPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        if self.form == "MaxPool2d":
            pooled = self.pool(h).flatten(1)
        elif self.form == "MaxPool2d(return_indices)":
            pooled = self.pool(h)[0].flatten(1)
        elif self.form == "AdaptiveMaxPool2d":
            pooled = self.adaptive(h).flatten(1)
        elif self.form == "amax":
            pooled = h.amax((2, 3))
        elif self.form == "amax(input=)":
            pooled = torch.amax(input=h, dim=(-2, -1))
        else:  # torch.max over one flattened dimension, kept
            pooled = torch.max(h.flatten(2), dim=-1, keepdim=True).values.squeeze(-1)
        return self.head(pooled)


@pytest.mark.parametrize("rule", ["deeplift.rescale", "deeplift.reveal_cancel"])
def test_deeplift_takes_its_max_pool_rule_at_every_form_of_max_pooling(rule):
    # the same function written five ways: one map, and it sums to f(x) - f(x0), which the
    # gradient's map (maxpool="gradient") does not
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    reference = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    forms = ["MaxPool2d", "MaxPool2d(return_indices)", "AdaptiveMaxPool2d", "amax", "max"]
    forms.append("amax(input=)")  # the input as a keyword raised an IndexError
    maps = []
    for form in forms:
        model = GlobalMax(form).double().eval()
        result = explain(model, x, rule, 1, baselines=reference)
        with torch.no_grad():
            difference = model(x)[:, 1] - model(reference)[:, 1]
        torch.testing.assert_close(result.attribution.sum((1, 2, 3)), difference)
        maps.append(result.attribution)
    for form, other in zip(forms[1:], maps[1:], strict=True):
        torch.testing.assert_close(other, maps[0], msg=form)
    gradient_rule = explain(model, x, rule, 1, baselines=reference, maxpool="gradient")
    assert not torch.allclose(gradient_rule.attribution, maps[0])


class MaximumOfTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.head = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.max(self.a(x), self.b(x)))  # a comparison, not a pooling


@pytest.mark.parametrize("rule", ["deeplift.rescale", "deeplift.reveal_cancel"])
def test_deeplift_refuses_a_maximum_of_two_tensors(rule):
    # taking the max-pool rule's operations into DeepLIFT's handler let it through unruled
    with pytest.raises(UnsupportedModelError, match="operation 'max'"):
        explain(MaximumOfTwo().double().eval(), torch.randn(3, 4, dtype=torch.float64), rule, 1)


class Arranged(nn.Module):
    """Two convolutions and a head; between the second and its ReLU, ``form`` arranges."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.form = form
        self.conv1, self.conv2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.pointwise = nn.Linear(4, 4)  # ConvNeXt's: conv2 as a Linear on channels last
        with torch.no_grad():
            self.pointwise.weight.copy_(self.conv2.weight[:, :, 0, 0])
            self.pointwise.bias.copy_(self.conv2.bias)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        if self.form == "channels-last Linear":
            h = self.pointwise(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        elif self.form == "channels-last F.linear":
            h = F.linear(h.permute(0, 2, 3, 1), self.pointwise.weight, self.pointwise.bias)
            h = h.permute(0, 3, 1, 2)
        else:
            h = self.conv2(h)
        if self.form == "view(shape)":
            h = h.view(h.shape)
        elif self.form == "reshape(input=)":  # the input as a keyword raised an IndexError
            h = torch.reshape(input=h, shape=h.shape)
        elif self.form == "permuted and back":
            h = h.permute(0, 2, 3, 1).permute(0, 3, 1, 2)
        y = self.head(torch.relu(h).mean((2, 3)))
        return y.view(-1, 3) if self.form == "view(shape)" else y


@pytest.mark.parametrize("rule", ["deeplift.reveal_cancel", "deeplift.ablation"])
def test_reveal_cancel_splits_a_layer_reshaped_or_permuted_before_its_relu_alike(rule):
    # the positive and negative parts of the layer's output were lost at the reshape (and
    # never made for F.linear): its ReLU (and the output, reshaped) took the difference split
    # by sign instead
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    forms = [
        "plain",
        "view(shape)",
        "permuted and back",
        "channels-last Linear",
        "channels-last F.linear",
        "reshape(input=)",
    ]
    maps = [explain(Arranged(form).double().eval(), x, rule, 1).attribution for form in forms]
    for form, other in zip(forms[1:], maps[1:], strict=True):
        torch.testing.assert_close(other, maps[0], msg=form)


def test_in_place_activations_give_the_same_maps_and_leave_inputs_alone():
    class InPlaceTanh(nn.Module):
        def forward(self, x):
            return x.tanh_()

    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    copy = x.clone()
    for in_place, out_of_place in [
        (lambda: nn.ELU(inplace=True), nn.ELU),
        (lambda: nn.LeakyReLU(0.1, inplace=True), lambda: nn.LeakyReLU(0.1)),
        (InPlaceTanh, nn.Tanh),
    ]:
        for method in ("lrp.epsilon_plus", "deeplift.rescale", "deeplift.reveal_cancel"):
            torch.testing.assert_close(
                explain(cnn(in_place), x, method, 2).attribution,
                explain(cnn(out_of_place), x, method, 2).attribution,
            )
    torch.testing.assert_close(x, copy, rtol=0, atol=0)


def test_an_activation_input_of_exactly_zero_uses_the_slope():
    model = mlp(nn.Sigmoid(), bias=False)
    x = torch.zeros(2, 5, dtype=torch.float64)  # z = 0: f(z)/z is undefined there
    x[1] = torch.randn(5, dtype=torch.float64)
    for method in ("lrp.epsilon", "deeplift.rescale"):
        attribution = explain(model, x, method, 0).attribution
        assert torch.isfinite(attribution).all()


@pytest.mark.parametrize(
    "method", ["guided_bp", "deconv", "rectgrad", "excitation_bp", "excitation_bp.contrastive"]
)
@pytest.mark.parametrize(
    ("activation", "op"),
    [(nn.Tanh(), "tanh"), (nn.Hardswish(), "hardswish"), (nn.PReLU(), "prelu")],
)
def test_methods_defined_on_relus_refuse_other_activations(method, activation, op):
    # Guided BP, Deconv and RectGrad change ReLU's backward and Excitation BP assumes
    # non-negative activations: none of them defines another activation's backward
    model = mlp(activation)
    kind = type(activation).__name__
    match = rf"'{op}' in module '1' \({kind}\) is an activation"
    with pytest.raises(UnsupportedModelError, match=match):
        explain(model, torch.randn(2, 5, dtype=torch.float64), method, 0)


def test_a_final_softmax_is_refused_with_advice_to_explain_the_logits():
    model = nn.Sequential(nn.Linear(5, 3), nn.Softmax(dim=1)).double().eval()
    with pytest.raises(UnsupportedModelError, match="returns the logits"):
        explain(model, torch.randn(2, 5, dtype=torch.float64), "lrp.epsilon", 0)


def test_onnx_export_of_lrp_takes_the_pass_rule_at_other_activations(tmp_path):
    for module in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(module, reason="the onnx extra is not installed")
    from explain_onnx import export_onnx

    model = mlp(nn.Tanh()).float()
    x = torch.rand(3, 5)
    x[0, 0] = 0.0  # where the rule takes f'(0), branch-free in the graph
    result = export_onnx(model, x, tmp_path / "m.onnx", explain="lrp.epsilon")
    assert result.parity is not None and result.parity.passed


@pytest.mark.parametrize("method", ["lrp.epsilon", "deeplift.rescale", "deeplift.reveal_cancel"])
def test_rrelu_in_eval_is_the_leaky_relu_of_its_mean_slope_and_refused_in_training(method):
    # refused as an operation without a rule before
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    got = explain(cnn(lambda: nn.RReLU(0.1, 0.3)), x, method, 1).attribution
    expected = explain(cnn(lambda: nn.LeakyReLU(0.2)), x, method, 1).attribution
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)

    class RandomSlopes(nn.Module):  # training=True in an eval model: random slopes per call
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.rrelu(x, training=True).flatten(1)

    with pytest.raises(UnsupportedModelError, match=r"'rrelu' in .*randomised leaky ReLU in train"):
        explain(RandomSlopes().eval(), x, method, 1, allow_training=True)

    class RandomSlopesPositional(nn.Module):  # torch.rrelu itself, as F.rrelu calls it
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.rrelu(x, 0.1, 0.3, True).flatten(1)

    for method_ in (method, "gradient"):  # the gradient changed from call to call
        with pytest.raises(ModelStateError, match="calls rrelu in training mode"):
            explain(RandomSlopesPositional().eval(), x, method_, 1)


class ScaledAddmm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layer, self.head = nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(self.layer.bias, x, self.layer.weight.t(), beta=0.5, alpha=2.0)
        return self.head(torch.relu(h))


@pytest.mark.parametrize("rule", ["deeplift.reveal_cancel", "deeplift.ablation"])
def test_reveal_cancel_refuses_an_addmm_it_cannot_split(rule):
    # with beta and alpha the output had no parts: its ReLU split the difference by sign
    with pytest.raises(UnsupportedModelError, match="'addmm' with beta or alpha"):
        explain(ScaledAddmm().double().eval(), torch.randn(3, 4, dtype=torch.float64), rule, 1)
    explain(
        ScaledAddmm().double().eval(), torch.randn(3, 4, dtype=torch.float64), "deeplift.rescale", 1
    )


class TimeMajor(nn.Module):
    """Features of each step, a nonlinearity and a pooling over time, with the batch moved
    (``form``) or first throughout ("batch first")."""

    def __init__(self, form: str, hidden: int = 5) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.form = form
        self.step, self.head = nn.Linear(4, hidden), nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, time, 4)
        if self.form == "batch first":
            return self.head(torch.relu(self.step(x)).amax(1))
        if self.form == "transposed and back":
            h = self.step(x.transpose(0, 1)).transpose(0, 1)
            return self.head(torch.relu(h).amax(1))
        if self.form == "stacked steps":  # a loop over time, its states stacked time-major
            step = self.step  # as an operation: RevealCancel keeps one record per module
            h = torch.stack([F.linear(x_t, step.weight, step.bias) for x_t in x.unbind(1)])
            return self.head(torch.relu(h).amax(0))
        if self.form == "max over time":  # time-major, ReLU'd batch first
            h = torch.relu(self.step(x)).permute(1, 0, 2)
            return self.head(h.max(0).values)
        h = torch.relu(self.step(x).transpose(0, 1))  # "time-major ReLU"
        return self.head(h.amax(0))


def _sums_to_difference(model: nn.Module, x: torch.Tensor, rule: str) -> None:
    reference = torch.randn_like(x)
    result = explain(model, x, rule, 1, baselines=reference)
    with torch.no_grad():
        difference = model(x)[:, 1] - model(reference)[:, 1]
    torch.testing.assert_close(result.attribution.sum((1, 2)), difference)


@pytest.mark.parametrize("rule", ["deeplift.rescale", "deeplift.reveal_cancel"])
@pytest.mark.parametrize("form", ["time-major ReLU", "stacked steps", "max over time"])
@pytest.mark.parametrize("steps", [7, 6])  # 6: as many as the stacked batch
def test_deeplift_refuses_a_nonlinearity_off_the_batch_axis(rule, form, steps):
    # its input's rows are not the inputs' and the references': the nonlinearity ran as written
    # (the gradient), or paired the wrong rows, and the map did not sum to f(x) - f(x0)
    model = TimeMajor(form).double().eval()
    x = torch.randn(3, steps, 4, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"first axis is not the batch.*\(in module"):
        explain(model, x, rule, 1)


@pytest.mark.parametrize(
    "rule, form, steps, hidden",
    [
        *(
            (rule, "batch first", steps, hidden)
            for rule in ("deeplift.rescale", "deeplift.reveal_cancel")
            for steps, hidden in ((7, 5), (6, 6))  # other axes as long as the stacked batch
        ),
        ("deeplift.rescale", "transposed and back", 7, 5),
        # a layer ran on the time-major tensor (the batch's axis there is not followed), and its
        # 6 steps are as many as the stacked batch's rows: no false refusal
        ("deeplift.rescale", "transposed and back", 6, 5),
    ],
)
def test_deeplift_takes_a_nonlinearity_with_the_batch_first(rule, form, steps, hidden):
    model = TimeMajor(form, hidden).double().eval()
    _sums_to_difference(model, torch.randn(3, steps, 4, dtype=torch.float64), rule)


class Recurrent(nn.Module):
    """An Elman RNN, time-major or batch first, whose last states feed a ReLU and a head."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.rnn = nn.RNN(4, 6, num_layers=2, batch_first=batch_first)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, time, 4)
        out, h_n = self.rnn(x if self.rnn.batch_first else x.transpose(0, 1))
        last = out[:, -1] if self.rnn.batch_first else out[-1]
        return self.head(torch.relu(h_n[-1]) + torch.relu(last))


@pytest.mark.parametrize("rule", ["deeplift.rescale", "deeplift.reveal_cancel"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_deeplift_follows_the_batch_through_a_recurrent_layer(rule, batch_first):
    # 3 samples, hidden size 6: each step's tanh, and the ReLUs on h_n[-1] and the last output,
    # have the stacked batch's 6 rows on two axes, after the layer (and the model) moved it
    model = Recurrent(batch_first).double().eval()
    _sums_to_difference(model, torch.randn(3, 6, 4, dtype=torch.float64), rule)


def test_reveal_cancel_refuses_a_layer_that_reads_a_moved_batch():
    # it split the layer's difference from reference at the wrong rows: torch's size error
    model = TimeMajor("transposed and back").double().eval()
    x = torch.randn(3, 7, 4, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"layer 'step' gets .* not the batch"):
        explain(model, x, "deeplift.reveal_cancel", 1)


class StepsConcatenated(nn.Module):
    """Per-step features made time-major by ``unsqueeze(0)`` and ``cat``, then a tanh."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.step, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, time, 3)
        z = self.step(x)
        steps = torch.cat([z[:, t].unsqueeze(0) for t in range(z.shape[1])])  # (time, batch, 4)
        return self.head(torch.tanh(steps).mean(0))


@pytest.mark.parametrize("rule", ["deeplift.rescale", "deeplift.reveal_cancel"])
def test_deeplift_refuses_a_time_major_tensor_made_by_concatenation(rule):
    # 5 steps, 2 samples: the time-major tensor's first axis is no batch of 4 rows
    model = StepsConcatenated().double().eval()
    with pytest.raises(UnsupportedModelError, match="first axis is not the batch"):
        explain(model, torch.randn(2, 5, 3, dtype=torch.float64), rule, 1)
