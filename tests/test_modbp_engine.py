"""The engine on real user models: composites, BatchNorm merging, residual code, checks, state."""

import collections
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, state_fingerprint
from modbp_nets import randomise_batchnorm, reference, resnet, vgg_bn
from torch import nn
from torch.overrides import TorchFunctionMode

from explain_core import Composite, Gradient, Rule, UnsupportedModelError, explain
from explain_core.engine import ModifiedBackprop
from explain_core.errors import InvalidInputError
from explain_modbp import (
    AlphaBeta,
    Epsilon,
    Gamma,
    ZBox,
    Zero,
    ZPlus,
)
from explain_modbp.composites import lrp_epsilon_plus

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sequential_reference(model, x, composite_rules, start):
    """Independent layer-by-layer LRP on a Sequential, using the dense matrix references."""
    layers = list(model)
    activations = [x]
    for layer in layers:
        activations.append(layer(activations[-1]).detach())
    relevance = start
    index = len(layers) - 1
    while index >= 0:
        layer = layers[index]
        h = activations[index]
        if isinstance(layer, nn.BatchNorm2d):  # merged with the conv before it
            pair = nn.Sequential(layers[index - 1], layer)
            relevance = reference(
                composite_rules(layers[index - 1]), pair, activations[index - 1], relevance
            )
            index -= 2
            continue
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            relevance = reference(composite_rules(layer), layer, h, relevance)
        elif isinstance(layer, nn.MaxPool2d):
            _, indices = F.max_pool2d(h, 2, return_indices=True)
            relevance = F.max_unpool2d(relevance, indices, 2, output_size=h.shape[-2:])
        elif isinstance(layer, nn.AvgPool2d):
            relevance = reference(Zero(), layer, h, relevance)
        elif isinstance(layer, nn.Flatten):
            relevance = relevance.reshape(h.shape)
        # ReLU and Dropout (eval): relevance passes unchanged
        index -= 1
    return relevance


def rules_epsilon_plus(layer):
    return ZPlus() if isinstance(layer, nn.Conv2d) else Epsilon(1e-6)


def rules_cmp(layer):
    return AlphaBeta(2.0, 1.0) if isinstance(layer, nn.Conv2d) else Zero()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "method, options, rules",
    [
        ("lrp.epsilon_plus", {}, rules_epsilon_plus),
        ("lrp.cmp", {"alpha": 2.0}, rules_cmp),
        ("lrp.alpha2beta1", {}, lambda layer: AlphaBeta(2.0, 1.0)),
        ("lrp.epsilon", {"epsilon": 0.1}, lambda layer: Epsilon(0.1)),
        ("lrp.gamma", {}, lambda layer: Gamma(0.25)),
        (
            "lrp.epsilon_gamma",
            {"gamma": 0.5},
            lambda layer: Gamma(0.5) if isinstance(layer, nn.Conv2d) else Epsilon(1e-6),
        ),
        (
            "lrp.epsilon_plus",
            {"bias": True},
            lambda layer: ZPlus(bias=True) if isinstance(layer, nn.Conv2d) else Epsilon(1e-6),
        ),
    ],
)
def test_composites_on_vgg_with_batchnorm_match_layerwise_reference(seed, method, options, rules):
    torch.manual_seed(seed)
    model = vgg_bn()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    result = explain(model, x, method, target=[0, 2, 4], **options)
    start = torch.zeros(3, 5, dtype=torch.float64)
    logits = model(x).detach()
    start[range(3), [0, 2, 4]] = logits[range(3), [0, 2, 4]]
    expected = sequential_reference(model, x, rules, start)
    torch.testing.assert_close(result.attribution, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("make", [vgg_bn, resnet], ids=["vgg_bn", "resnet"])
def test_lrp_zero_equals_input_times_gradient_on_relu_networks(make):
    model = make()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    lrp = explain(model, x, "lrp.z", target=1)
    ixg = explain(model, x, "input_x_gradient", target=1)
    torch.testing.assert_close(lrp.attribution, ixg.attribution, rtol=1e-9, atol=1e-12)


def test_resnet_merges_every_batchnorm_and_conserves_relevance_without_biases():
    model = resnet(bias=False)
    for m in model.modules():  # BatchNorm shifts act as biases: remove them for conservation
        if isinstance(m, nn.BatchNorm2d):
            m.bias.data.zero_()
            m.running_mean.zero_()
    x = torch.rand(3, 3, 8, 8, dtype=torch.float64)
    forward = ModifiedBackprop(lrp_epsilon_plus(1e-12), record=True).forward(model, x)
    assert forward.plan.merged == {
        "conv1": "bn1",
        "layer1.conv1": "layer1.bn1",
        "layer1.conv2": "layer1.bn2",
        "layer2.conv1": "layer2.bn1",
        "layer2.conv2": "layer2.bn2",
        "layer2.downsample.0": "layer2.downsample.1",
    }
    for method in ("lrp.z", "lrp.zplus", "lrp.alpha2beta1", "lrp.epsilon_plus", "lrp.w2"):
        result = explain(
            model, x, method, target=2, **({"epsilon": 1e-12} if "eps" in method else {})
        )
        torch.testing.assert_close(result.delta, torch.zeros(3).double(), atol=1e-9, rtol=0)
    result = explain(model, x, "excitation_bp", target=2)
    torch.testing.assert_close(
        result.attribution.sum((1, 2, 3)), torch.ones(3).double(), rtol=1e-9, atol=1e-9
    )


class _CountCalls(TorchFunctionMode):
    """A user's mode (an operation counter, a profiler) around the call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen[getattr(func, "__name__", repr(func))] += 1
        return func(*args, **(kwargs or {}))


def test_a_users_function_mode_sees_the_models_operations_and_not_the_rules_arithmetic():
    model = resnet()
    x = torch.rand(2, 3, 8, 8, dtype=torch.float64)
    expected = explain(model, x, "lrp.epsilon_plus", target=1).attribution
    with _CountCalls() as plain:
        model(x)
    with _CountCalls() as explained:
        result = explain(model, x, "lrp.epsilon_plus", target=1)
    torch.testing.assert_close(result.attribution, expected, rtol=0, atol=0)
    # The model's convolutions, batch norms and ReLUs once each, as in a plain forward; the
    # rules' merged weights (rsqrt), z⁺ weights (clamp) and their convolutions not at all.
    for name in ("conv2d", "batch_norm", "relu", "rsqrt", "clamp"):
        assert explained.seen[name] == plain.seen[name], (name, explained.seen[name])


def test_relevance_injected_at_a_layer_is_read_at_every_lower_layer():
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3)
    ).double()
    x = torch.randn(2, 6, dtype=torch.float64)
    composite = Composite([(nn.Linear, ZPlus())])
    forward = ModifiedBackprop(composite, record=True).forward(model, x)
    assert forward.layers == ["0", "2", "4"]
    v = torch.randn(2, 7, dtype=torch.float64)
    result = forward.backward(start="2", relevance=v, read_layers=True, retain_graph=True)
    h1 = model[1](model[0](x)).detach()
    r2 = reference(ZPlus(), model[2], h1, v)
    torch.testing.assert_close(h1 * result.layer_signals["2"], r2)
    r0 = reference(ZPlus(), model[0], x, r2)
    torch.testing.assert_close(x * result.layer_signals["0"], r0)
    torch.testing.assert_close(x * result.input_signal, r0)
    # a signal injected at a layer's output starts there; 0 where the ReLU reading it is off
    # (z⁺ gives those outputs no signal: the ReLU's gradient; test_modbp_rules checks refusals)
    z2 = model[2](h1).detach()
    masked = torch.rand(2, 7, dtype=torch.float64) * (z2 > 0)
    signal = forward.backward(masked, start="2").input_signal
    r0 = reference(ZPlus(), model[0], x, reference(ZPlus(), model[2], h1, z2 * masked))
    torch.testing.assert_close(x * signal, r0)


def test_functional_and_inplace_relu_dropout_and_views_are_supported():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 4, 3)
            self.drop = nn.Dropout(0.3)
            self.fc = nn.Linear(4 * 3, 3)

        def forward(self, x):
            x = F.relu(self.conv(x), inplace=True)
            x = self.drop(x)
            x = x.view(x.size(0), -1)
            return self.fc(torch.relu(x) * 2.0)

    model = Net().double().eval()
    x = torch.randn(2, 2, 5, dtype=torch.float64)
    lrp = explain(model, x, "lrp.z", target=0)
    ixg = explain(model, x, "input_x_gradient", target=0)
    torch.testing.assert_close(lrp.attribution, ixg.attribution)


def test_model_state_is_identical_after_attribution_and_after_exceptions():
    model = resnet()
    model.user_attribute = [1, 2]
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    expected = model(x).detach()
    before = state_fingerprint(model)
    for method in ("lrp.epsilon_plus", "lrp.cmp", "excitation_bp", "lrp.contrastive"):
        explain(model, x, method)
        assert_same_state(before, state_fingerprint(model))
    # an error inside a rule in the middle of the forward pass
    with pytest.raises(InvalidInputError, match="z\\^B bounds"):
        explain(model, x * 10, "lrp.zb", low=-1.0, high=1.0)
    assert_same_state(before, state_fingerprint(model))
    with pytest.raises(UnsupportedModelError):
        ModifiedBackprop(Composite([(nn.Linear, ZPlus())])).forward(model, x)
    assert_same_state(before, state_fingerprint(model))
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert model.user_attribute == [1, 2]


@pytest.mark.parametrize(
    "method",
    ["lrp.epsilon", "lrp.zplus", "lrp.gamma", "lrp.alpha2beta1", "deeplift.rescale", "guided_bp"],
)
def test_a_reused_module_is_explained_as_copies_of_it_with_its_weights(method):
    # A known equivalence: the rule applies at every call, as to copies of the module.
    shared = nn.Linear(4, 4).double()
    model = nn.Sequential(shared, nn.ReLU(), shared).eval()
    copies = nn.Sequential(shared, nn.ReLU(), copy.deepcopy(shared)).eval()
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = explain(copies, x, method, 1).attribution
    assert expected.abs().sum() > 0
    before = state_fingerprint(model)
    torch.testing.assert_close(explain(model, x, method, 1).attribution, expected)
    assert_same_state(before, state_fingerprint(model))


@pytest.mark.parametrize(
    ("method", "match"),
    [
        ("lrp.w2", r"'0' \(Linear\) is called 2 times .* on the model input in some calls"),
        ("excitation_bp.contrastive", r"'0' \(Linear\) is called 2 times .* output layer"),
        ("deeplift.reveal_cancel", r"'0' is called more than once .* one record per layer"),
        ("deeplift.ablation", r"'0' is called more than once .* one record per layer"),
    ],
)
def test_a_reused_module_whose_calls_need_different_rules_is_refused(method, match):
    # the input-layer rule, the output-layer rule, per-layer records: one call each
    shared = nn.Linear(4, 4).double()
    model = nn.Sequential(shared, nn.ReLU(), shared).eval()
    with pytest.raises(UnsupportedModelError, match=match):
        explain(model, torch.randn(2, 4, dtype=torch.float64), method, 1)
    assert not shared._forward_hooks and not shared._forward_pre_hooks


def test_unsupported_layer_is_an_error_naming_path_type_and_how_to_register():
    model = nn.Sequential(nn.Linear(4, 4), nn.LogSigmoid(), nn.Linear(4, 2)).double().eval()
    match = r"'log_sigmoid' in module '1' \(LogSigmoid\).*with_rules\(\(LogSigmoid, MyRule"
    with pytest.raises(UnsupportedModelError, match=match):
        explain(model, torch.randn(2, 4).double(), "lrp.zplus")


def test_custom_rule_registered_for_an_unsupported_layer_is_used():
    class TanhRule(Rule):  # the exact gradient, in the signal convention
        def backward(self, call, grad_output):
            return (grad_output * (1 - call.output**2),)

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    x = torch.randn(3, 4).double()
    composite = Composite([(nn.Linear, Zero())]).with_rules((nn.Tanh, TanhRule()))
    forward = ModifiedBackprop(composite).forward(model, x)
    signal = forward.backward(torch.tensor([[1.0, 0.0]] * 3).double()).input_signal
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(xg)[:, 0].sum(), xg)
    torch.testing.assert_close(signal, grad)


@pytest.mark.parametrize(
    "forward, message",
    [
        (
            lambda self, x: torch.einsum("bi,ji->bj", x, self.fc.weight),
            r"'einsum' in module '<root>' \(Net\)",
        ),
        (lambda self, x: self.fc(x) * self.fc2(x), r"'mul'.*multiplies"),
        (
            lambda self, x: self.fc(x) @ (self.fc2(x).T @ self.fc2(x)),
            r"'matmul' in module '<root>' \(Net\) multiplies two input-dependent tensors, "
            r"which no dense rule applies to.*explain with AttnLRP or CP-LRP",
        ),
        (
            lambda self, x: F.linear(x, self.fc2(x).sum(0)[:, None].expand(3, 4)),  # from the input
            r"'linear' in module '<root>' \(Net\) multiplies two input-dependent tensors",
        ),
        (
            lambda self, x: (self.fc.weight @ x.T).T,  # the weight on the left
            r"'matmul' in module '<root>' \(Net\) is not a dense layer's product.*x @ W",
        ),
        (lambda self, x: self.fc(F.logsigmoid(x)), r"'log_sigmoid' in module '<root>'"),
        (
            lambda self, x: self.fc(torch.fft.rfft(x, n=6).abs()),
            r"'fft_rfft' in module '<root>' \(Net\).*spectral front-end.*outside the model",
        ),
    ],
    ids=[
        "einsum",
        "product",
        "matmul_of_activations",
        "linear_of_activations",
        "weight_left",
        "log_sigmoid",
        "fft",
    ],
)
def test_operations_the_engine_cannot_see_are_errors(forward, message):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.fc2 = nn.Linear(4, 3)

    Net.forward = forward
    model = Net().double().eval()
    with pytest.raises(UnsupportedModelError, match=message):
        explain(model, torch.randn(2, 4).double(), "lrp.epsilon")


@pytest.mark.parametrize("method", ["deeplift.rescale", "guided_bp", "lrp.attn"])
def test_a_weight_made_from_the_input_is_refused_where_the_gradient_is_the_dense_rule(method):
    # Their gradient through F.linear passed a product of two activations unchecked, which none
    # of them has a rule for (AttnLRP's linear rule is the gradient by default).
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return F.linear(torch.relu(x), self.fc(x).sum(0)[:, None].expand(3, 4))

    with pytest.raises(UnsupportedModelError, match=r"'linear' .* multiplies two input-depend"):
        explain(Net().double().eval(), torch.randn(2, 4).double(), method, 1)


LRP_DENSE = ("lrp.epsilon", "lrp.zplus", "lrp.epsilon_plus")


# DeepLIFT takes F.linear only: its gradient would pass a matrix product of two activations too,
# for which it has no rule.
@pytest.mark.parametrize(
    ("method", "how"),
    [
        *((method, how) for method in LRP_DENSE for how in ("linear", "matmul", "mm")),
        ("deeplift.rescale", "linear"),
    ],
)
def test_f_linear_in_forward_gets_the_dense_layers_rule(method, how):
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc, self.out = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            h = torch.relu(F.linear(x, self.fc.weight, self.fc.bias))
            if how == "linear":
                return F.linear(h, self.out.weight)
            if how == "matmul":  # a projection written as a matrix product (CLIP's heads)
                return h @ self.out.weight.T
            return torch.mm(h, self.out.weight.T)

    model = Functional().double().eval()
    modules = nn.Sequential(model.fc, nn.ReLU(), nn.Linear(6, 2, bias=False)).double().eval()
    modules[2].weight = model.out.weight
    x = torch.randn(3, 4).double()
    torch.testing.assert_close(
        explain(model, x, method, 1).attribution, explain(modules, x, method, 1).attribution
    )


def test_batchnorm_that_cannot_be_merged_and_unmapped_layers_are_errors():
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)).double().eval()
    with pytest.raises(UnsupportedModelError, match=r"no rule for module '0' \(BatchNorm1d\)"):
        explain(model, torch.randn(2, 4).double(), "excitation_bp")
    # mapping it explicitly makes it a per-channel affine layer
    composite = Composite([(nn.Linear, Zero()), (nn.BatchNorm1d, Zero())])
    x = torch.randn(3, 4).double()
    forward = ModifiedBackprop(composite).forward(model, x)
    relevance = x * forward.backward(torch.tensor([[1.0, 0.0]] * 3).double()).input_signal
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(xg)[:, 0].sum(), xg)
    torch.testing.assert_close(relevance, x * grad)
    conv_only = Composite([(nn.Conv2d, ZPlus())])
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with pytest.raises(UnsupportedModelError, match=r"no rule for module '0' \(Linear\)"):
        ModifiedBackprop(conv_only).forward(mlp, x)


def test_input_layer_rules_are_refused_on_inner_layers_and_padding_modes():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    composite = Composite([("2", ZBox(0.0, 1.0)), (nn.Linear, ZPlus())])
    with pytest.raises(UnsupportedModelError, match="only applies to the layer reading"):
        ModifiedBackprop(composite).forward(model, torch.rand(2, 4).double())
    reflect = nn.Sequential(nn.Conv1d(1, 1, 3, padding=1, padding_mode="reflect"), nn.Flatten())
    with pytest.raises(UnsupportedModelError, match="padding_mode='reflect'"):
        explain(reflect.double(), torch.randn(2, 1, 4).double(), "lrp.epsilon")


def test_bad_inputs_give_clear_errors():
    model = vgg_bn()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match=r"target must lie in \[0, 4\]"):
        explain(model, x, "lrp.epsilon_plus", target=5)
    with pytest.raises(InvalidInputError, match="z\\^B rule needs the input's bounds"):
        explain(model, x, "lrp.zb")
    with pytest.raises(InvalidInputError, match="does not fit the inputs"):
        explain(model, x, "lrp.zb", low=torch.zeros(5), high=1.0)
    with pytest.raises(InvalidInputError, match="alpha - beta must be 1"):
        explain(model, x, "lrp.alpha_beta", alpha=3.0, beta=1.0)


def test_gradient_rule_needs_no_hooks_and_is_the_gradient():
    model = vgg_bn()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    composite = Composite([((nn.Conv2d, nn.Linear), Gradient())])
    forward = ModifiedBackprop(composite).forward(model, x)
    assert forward.records == {}
    signal = forward.backward(F.one_hot(torch.tensor([1, 1]), 5).double()).input_signal
    ixg = explain(model, x, "gradient", target=1).attribution
    torch.testing.assert_close(signal, ixg)


def test_recorded_gradient_layers_give_the_signal_at_every_layer_input():
    model = vgg_bn()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    composite = Composite([((nn.Conv2d, nn.Linear), Gradient())])
    forward = ModifiedBackprop(composite, record=True).forward(model, x)
    assert forward.layers == ["0", "3", "7", "12", "14"]
    start = F.one_hot(torch.tensor([1, 3]), 5).double()
    result = forward.backward(start, read_layers=True)
    xg = x.clone().requires_grad_(True)
    h = model[:12](xg)
    (expected,) = torch.autograd.grad(model[12:](h), h, start)
    torch.testing.assert_close(result.layer_signals["12"], expected)
    torch.testing.assert_close(result.input_signal, torch.autograd.grad(model(xg), xg, start)[0])


def test_affine_subclass_with_its_own_forward_is_refused():
    class StandardisedConv(nn.Conv2d):
        def forward(self, x):
            w = (self.weight - self.weight.mean()) / self.weight.std()
            return self._conv_forward(x, w, self.bias)

    model = nn.Sequential(StandardisedConv(2, 3, 3), nn.Flatten(), nn.Linear(12, 2)).double()
    with pytest.raises(UnsupportedModelError, match=r"'0' \(StandardisedConv\) does not compute"):
        explain(model.eval(), torch.randn(2, 2, 4, 4).double(), "lrp.epsilon_plus")


def _error_to_float64(model: nn.Module, x: torch.Tensor, method: str) -> float:
    """Max error of ``method``'s map against the same weights and inputs in float64 (exact)."""
    half = explain(model, x, method, target=[0, 2, 4]).attribution
    exact = explain(copy.deepcopy(model).double(), x.double(), method, target=[0, 2, 4])
    gap = (half.double() - exact.attribution).abs().max() / exact.attribution.abs().max()
    return float(gap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_batchnorm_nets_in_half_precision_are_explained_as_accurately_as_the_gradient(dtype):
    # BatchNorm's kernel rounds once, the merged affine map at each step: in bfloat16 they
    # differed by more than the trace's check allowed, which refused plain BatchNorm layers.
    # Where a ReLU's input rounds to the other side of 0, any map of the half-precision model
    # moves (the gradient's too): the yardstick is the gradient's own error, or 16 roundings.
    for seed in range(5):
        torch.manual_seed(seed)
        model, x = copy.deepcopy(vgg_bn()).to(dtype), torch.randn(3, 3, 8, 8).to(dtype)
        allowed = max(_error_to_float64(model, x, "gradient"), 16 * torch.finfo(dtype).eps)
        assert _error_to_float64(model, x, "lrp.epsilon_plus") <= allowed
        deeplift = explain(model, x, "deeplift.rescale", target=[0, 2, 4]).attribution
        assert deeplift.dtype == dtype and bool(deeplift.isfinite().all())


def test_affine_subclass_with_its_own_forward_is_refused_in_bfloat16_too():
    class StandardisedConv(nn.Conv2d):
        def forward(self, x):
            w = (self.weight - self.weight.mean()) / self.weight.std()
            return self._conv_forward(x, w, self.bias)

    torch.manual_seed(0)
    model = nn.Sequential(StandardisedConv(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))
    with pytest.raises(UnsupportedModelError, match=r"'0' \(StandardisedConv\) does not compute"):
        explain(model.bfloat16().eval(), torch.randn(2, 2, 4, 4).bfloat16(), "lrp.epsilon_plus")


class ResidualBlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 5 * 5, 4)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(h)) + x)
        return self.fc(out.flatten(1))


@pytest.mark.parametrize(
    "method, options, rule",
    [
        ("lrp.zplus", {}, ZPlus()),
        ("lrp.zplus", {"bias": True}, ZPlus(bias=True)),
        ("lrp.alpha2beta1", {}, AlphaBeta()),
        # the branch's second conv has outputs of both signs: the generalised rule's z < 0 case
        ("lrp.gamma", {}, Gamma(0.25)),
    ],
)
def test_residual_block_matches_hand_written_reference(method, options, rule):
    torch.manual_seed(4)
    model = randomise_batchnorm(ResidualBlockNet()).double().eval()
    x = torch.rand(2, 3, 5, 5, dtype=torch.float64)
    result = explain(model, x, method, target=[1, 3], **options)
    with torch.no_grad():
        h = F.relu(model.bn1(model.conv1(x)))
        a = model.bn2(model.conv2(h))
        s = a + x
        out = F.relu(s).flatten(1)
        logits = model.fc(out)
    start = torch.zeros_like(logits)
    start[[0, 1], [1, 3]] = logits[[0, 1], [1, 3]]
    r_out = reference(rule, model.fc, out, start).reshape(s.shape)  # passes the final ReLU
    share = torch.where(s == 0, 0.0, r_out / torch.where(s == 0, 1.0, s))
    r_a, r_x_skip = a * share, x * share  # LRP-0 split of the residual sum
    r_h = reference(rule, nn.Sequential(model.conv2, model.bn2), h, r_a)
    r_x = reference(rule, nn.Sequential(model.conv1, model.bn1), x, r_h) + r_x_skip
    torch.testing.assert_close(result.attribution, r_x, rtol=1e-8, atol=1e-10)


class CaptumCNN(nn.Module):
    """Modules Captum's LRP has rules for (it has none for nn.Flatten: flattened in forward)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.AvgPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Linear(8 * 2 * 2, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


@pytest.mark.parametrize("seed", [0, 1])
def test_epsilon_plus_equals_captum_lrp(seed):
    """Captum's LRP with z⁺ on convolutions (bias left out, the paper's Eq. 5) and ε on dense."""
    captum = pytest.importorskip("captum.attr")
    from captum.attr._utils.lrp_rules import Alpha1_Beta0_Rule, EpsilonRule

    torch.manual_seed(seed)
    model = CaptumCNN().double().eval()
    x = torch.rand(3, 3, 12, 12, dtype=torch.float64)  # non-negative: Captum's z⁺ has no x⁻ form
    target = [0, 4, 2]
    ours = explain(model, x, "lrp.epsilon_plus", target=target).attribution
    theirs_model = copy.deepcopy(model)  # Captum's rules are attributes set on the modules
    for module in theirs_model.modules():
        if isinstance(module, nn.Conv2d):
            module.rule = Alpha1_Beta0_Rule(set_bias_to_zero=True)
        elif isinstance(module, nn.Linear):
            module.rule = EpsilonRule(epsilon=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = captum.LRP(theirs_model).attribute(x, target=target).detach()
    # Captum adds 1e-9·sign(z) to every denominator: compare against the map's scale
    assert (ours - theirs).abs().max() <= 1e-7 * theirs.abs().max()


class _ReadsWhatItDisowns(Epsilon):
    """ε that says its backward does not read the input, then reads it anyway."""

    def __init__(self, how: str) -> None:
        super().__init__(0.01)
        self.how = how

    def backward(self, call, grad_output):
        x = call.inputs[0]
        (signal,) = super().backward(call, grad_output)
        if self.how == "with a signal":  # mixes devices: torch raises deep inside
            return (signal * (x > 0),)
        return (x.clamp(min=0),)  # the stand-in alone: a tensor on the meta device


@pytest.mark.parametrize("how", ["with a signal", "alone"])
def test_a_rule_that_reads_an_input_it_said_it_does_not_read_gets_a_clear_error(how):
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    composite = Composite([(nn.Linear, _ReadsWhatItDisowns(how))])
    before = state_fingerprint(model)
    with pytest.raises(InvalidInputError, match="reads_input_in_backward returned False") as caught:
        explain(model, x, "lrp.custom", 1, composite=composite)
    assert "layer '2'" in str(caught.value) and "return True" in str(caught.value)
    assert_same_state(before, state_fingerprint(model))
    recorded = ModifiedBackprop(composite, record=True).forward(model, x)  # keeps the inputs
    recorded.backward(torch.ones(3, 2, dtype=torch.float64))


@pytest.mark.parametrize("how", ["start", "read_layers"])
def test_starting_at_or_reading_a_layer_of_a_pass_that_recorded_none_says_to_record(how):
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    forward = ModifiedBackprop(Composite([(nn.Linear, ZPlus())])).forward(model, x)
    assert forward.records == {}
    options = {"start": "2"} if how == "start" else {"read_layers": True}
    with pytest.raises(InvalidInputError, match=r"record=True"):
        forward.backward(torch.ones(3, 5 if how == "start" else 2, dtype=torch.float64), **options)
    plain = forward.backward(torch.ones(3, 2, dtype=torch.float64)).input_signal  # still usable
    recorded = ModifiedBackprop(Composite([(nn.Linear, ZPlus())]), record=True).forward(model, x)
    torch.testing.assert_close(recorded.backward(torch.ones(3, 2).double()).input_signal, plain)


class Selection(nn.Module):
    """Linear → a fixed selection of its features (``how``) → Linear."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.first, self.last, self.how = nn.Linear(4, 6), nn.Linear(5, 2), how
        self.index = torch.tensor([5, 0, 3, 3, 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        rows = self.index.expand(len(x), -1)
        if self.how == "index_select":
            h = h.index_select(1, self.index)
        elif self.how == "gather":
            h = h.gather(1, rows)
        elif self.how == "take_along_dim":
            h = torch.take_along_dim(h, rows, dim=1)
        elif self.how == "input-dependent":
            h = h.index_select(1, (h[0, :5] * 0).to(torch.int64))  # zeros, made from h
        else:  # the reference: indexing, which the engine has long supported
            h = h[:, self.index]
        return self.last(h)


class MaxOver(nn.Module):
    """Linear → ReLU → a maximum over the last dimension of (batch, 3, 4) (``how``) → Linear."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.first, self.last, self.how = nn.Linear(4, 12), nn.Linear(3, 2), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x)).view(-1, 3, 4)
        if self.how == "max":
            h = h.max(2).values
        elif self.how == "torch.max":
            h = torch.max(h, dim=-1, keepdim=True)[0].squeeze(-1)
        elif self.how == "amax":
            h = h.amax(2)
        elif self.how == "of two tensors":
            h = torch.max(h, h.flip(2))[..., 0]
        else:  # the reference: max pooling over that dimension
            h = F.adaptive_max_pool1d(h, 1).squeeze(-1)
        return self.last(h)


def assert_explained_alike(model: nn.Module, reference: nn.Module, method: str) -> None:
    """``model`` gets the maps of ``reference``, the same function in long-supported operations."""
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = explain(reference.double().eval(), x, method, 1).attribution
    assert expected.abs().sum() > 0
    torch.testing.assert_close(explain(model.double().eval(), x, method, 1).attribution, expected)


@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.zplus", "deeplift.rescale", "guided_bp"])
@pytest.mark.parametrize("how", ["index_select", "gather", "take_along_dim"])
def test_selections_by_a_fixed_index_equal_indexing(how, method):
    assert_explained_alike(Selection(how), Selection("getitem"), method)


@pytest.mark.parametrize(
    "method", ["lrp.epsilon", "lrp.zplus", "deeplift.rescale", "guided_bp", "excitation_bp"]
)
@pytest.mark.parametrize("how", ["max", "torch.max", "amax"])
def test_a_maximum_over_a_dimension_is_max_pooling_over_it(how, method):
    assert_explained_alike(MaxOver(how), MaxOver("pool"), method)


@pytest.mark.parametrize(
    ("kind", "how", "match"),
    [
        (Selection, "input-dependent", r"'index_select' .* selects with an input-dependent index"),
        (MaxOver, "of two tensors", r"'max' .* no relevance rule.* a maximum of two tensors is a"),
    ],
)
def test_a_selection_by_the_input_or_a_maximum_of_two_tensors_is_refused_by_name(kind, how, match):
    model = kind(how).double().eval()
    with pytest.raises(UnsupportedModelError, match=match):
        explain(model, torch.randn(2, 4, dtype=torch.float64), "lrp.epsilon", 1)


class FunctionalHead(nn.Module):
    """The output layer called as ``F.linear`` in forward (an operation, not a module), after a
    module named as the operation is."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.head = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(self.linear(x)), self.head.weight, self.head.bias)


class RecurrentOutput(nn.Module):
    """A ReLU RNN's last state read as the scores, after a Linear: no Linear at the output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.rnn = nn.RNN(4, 5, nonlinearity="relu", batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(F.relu(self.embed(x)))[0][:, -1, :3]


@pytest.mark.parametrize(
    ("model", "x", "layer"),
    [
        (
            FunctionalHead,
            torch.randn(2, 5),
            r"operation 'linear' in module '<root>' \(FunctionalHead\)",
        ),
        (RecurrentOutput, torch.randn(2, 6, 4), r"module 'rnn' \(RNN\)"),
    ],
)
def test_an_output_layer_rule_refuses_an_output_layer_that_is_an_operation(model, x, layer):
    # The output-layer rule went to the last Linear module, which is not the output layer (or
    # to none): the contrastive map was another method's, silently.
    with pytest.raises(
        UnsupportedModelError, match=rf"on the output layer, but .* by {layer}, not"
    ):
        explain(model().eval(), x, "excitation_bp.contrastive", 1)
    explain(model().eval(), x, "excitation_bp", 1)  # no output-layer rule: explained
