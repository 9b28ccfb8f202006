"""The modified-backprop engine on the shapes of code users write, against hand-written references.

Constants added to activations, normalisation inside ``forward``, BatchNorm on token axes, user
hooks, flags read by ``forward``, BatchNorms after ReLUs and explicit padding modules.
"""

import dataclasses
import enum
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import (
    Gradient,
    InvalidInputError,
    UnsupportedModelError,
    explain,
    explain_inputs,
)
from explain_core.engine.plan_cache import clear_plan_cache
from explain_modbp import Epsilon, composites


def zplus_reference(x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """z⁺ of a Linear layer, inputs of any sign: ``Σ_j [x_i w_ji]⁺ / Σ_i' [x_i' w_ji']⁺ R_j``."""
    positive = (x[:, None, :] * weight[None]).clamp(min=0)  # (batch, out, in)
    total = positive.sum(2, keepdim=True)
    share = torch.where(total > 0, positive / total.where(total > 0, 1.0), 0.0)
    return (share * relevance[:, :, None]).sum(1)


def split_by_value(part: torch.Tensor, whole: torch.Tensor, relevance: torch.Tensor):
    """LRP-0 through a sum with other terms: ``part / whole · R`` (0 where the sum is 0)."""
    return torch.where(whole != 0, part / whole.where(whole != 0, 1.0), 0.0) * relevance


def logit_relevance(output: torch.Tensor, target: int) -> torch.Tensor:
    relevance = torch.zeros_like(output)
    relevance[:, target] = output[:, target]
    return relevance


class Shifted(nn.Module):
    """``fc3(relu(fc2(relu(fc1(x)) + shift)))`` with a negative shift parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.shift = nn.Parameter(torch.linspace(-1.0, 0.2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)) + self.shift)))

    def reference(self, x: torch.Tensor, target: int) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        y = h + self.shift
        a = F.relu(self.fc2(y))
        out = self.fc3(a)
        relevance = zplus_reference(a, self.fc3.weight, logit_relevance(out, target))
        relevance = zplus_reference(y, self.fc2.weight, relevance)
        return zplus_reference(x, self.fc1.weight, split_by_value(h, y, relevance))


class Coordinates(nn.Module):
    """``fc2(relu(cat([relu(fc1(x)), coordinates])))``: a constant of either sign joined in."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 5), nn.Linear(8, 6), nn.Linear(6, 3)
        self.register_buffer("coordinates", torch.tensor([[-1.0, 0.0, 1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([F.relu(self.fc1(x)), self.coordinates.expand(len(x), -1)], 1)
        return self.fc3(F.relu(self.fc2(joined)))

    def reference(self, x: torch.Tensor, target: int) -> torch.Tensor:
        joined = torch.cat([F.relu(self.fc1(x)), self.coordinates.expand(len(x), -1)], 1)
        a = F.relu(self.fc2(joined))
        out = self.fc3(a)
        relevance = zplus_reference(a, self.fc3.weight, logit_relevance(out, target))
        relevance = zplus_reference(joined, self.fc2.weight, relevance)[:, :5]
        return zplus_reference(x, self.fc1.weight, relevance)


class Difference(nn.Module):
    """``torch.add(p, q, alpha=-1)`` of two ReLU branches: non-negative terms, signed result."""

    def __init__(self) -> None:
        super().__init__()
        self.p, self.q, self.out = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.add(F.relu(self.p(x)), F.relu(self.q(x)), alpha=-1))

    def reference(self, x: torch.Tensor, target: int) -> torch.Tensor:
        p, q = F.relu(self.p(x)), F.relu(self.q(x))
        y = p - q
        out = self.out(y)
        relevance = zplus_reference(y, self.out.weight, logit_relevance(out, target))
        from_p = zplus_reference(x, self.p.weight, split_by_value(p, y, relevance))
        return from_p + zplus_reference(x, self.q.weight, split_by_value(-q, y, relevance))


@pytest.mark.parametrize("net", [Shifted, Coordinates, Difference])
@pytest.mark.parametrize("seed", [0, 1])
def test_zplus_sees_signed_operands_of_additions_and_joins(net, seed):
    # The trace marks a tensor non-negative (so z⁺ drops its x⁻ terms) only if every operand of
    # an addition or concatenation is: constants, parameters and alpha count too.
    torch.manual_seed(seed)
    model = net().double().eval()
    x = torch.randn(5, 6, dtype=torch.float64)
    got = explain(model, x, "lrp.zplus", target=1).attribution
    with torch.no_grad():
        torch.testing.assert_close(got, model.reference(x, 1))


class Normalising(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1))
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / self.std
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).mean((2, 3)))


@pytest.mark.parametrize(
    ("method", "options"),
    [("lrp.w2", {}), ("lrp.flat", {}), ("lrp.zb", {"low": 0.0, "high": 1.0})],
)
def test_input_layer_rules_refuse_a_first_layer_that_reads_a_transformed_input(method, options):
    model = Normalising().eval()
    before = state_fingerprint(model)
    reader = r"operation 'sub' in module '<root>' \(Normalising\) reads it first"
    with pytest.raises(UnsupportedModelError, match=reader):
        explain(model, torch.rand(2, 3, 8, 8), method, target=0, **options)
    assert_same_state(before, state_fingerprint(model))
    # the same layers reading the input directly get the rule
    plain = nn.Sequential(model.conv1, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)).eval()
    w2 = explain(plain, torch.rand(2, 3, 8, 8), method, target=0, **options).attribution
    assert w2.shape == (2, 3, 8, 8)


class NormalisingInPlace(Normalising):
    """The same normalisation written in place, into a copy of the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.sub_(self.mean).div_(self.std)
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).mean((2, 3)))


def test_input_layer_rules_refuse_an_input_normalised_in_place_in_a_copy():
    # The copy counted as the input itself after it was changed: lrp.w2 ran on normalised
    # values, and z^B said the inputs left the bounds the user's inputs were in
    model = NormalisingInPlace().eval()
    reader = r"operation 'sub_' in module '<root>' \(NormalisingInPlace\) reads it first"
    for method, options in INPUT_LAYER_PRESETS:
        with pytest.raises(UnsupportedModelError, match=reader):
            explain(model, torch.rand(2, 3, 8, 8), method, target=0, **options)


def test_input_layer_rules_refuse_a_batchnorm_that_normalises_the_input():
    # nn.BatchNorm2d(3, affine=False) in front, as a data normalisation: the rule went onto the
    # BatchNorm, where w² and flat are the identity, and the first convolution took z⁺
    model = nn.Sequential(
        nn.BatchNorm2d(3, affine=False), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten()
    )
    model = nn.Sequential(*model, nn.Linear(4 * 36, 3)).eval()
    model[0].running_mean.fill_(0.5)
    for method, options in INPUT_LAYER_PRESETS:
        with pytest.raises(UnsupportedModelError, match=r"'0' \(BatchNorm2d\), which normalises"):
            explain(model, torch.rand(2, 3, 8, 8), method, target=0, **options)
    # a composite without an input-layer rule takes the BatchNorm as the affine map it is
    result = explain(model, torch.rand(2, 3, 8, 8), "lrp.epsilon_plus", 0)
    assert result.attribution.shape == (2, 3, 8, 8)


class RawInputPastFirstLayer(nn.Module):
    """The raw input also reaches the output past the first convolution: added or concatenated."""

    def __init__(self, join: str) -> None:
        super().__init__()
        self.join = join
        self.conv = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.fc = nn.Linear(6 if join == "cat" else 3, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        h = torch.cat([h, x], 1) if self.join == "cat" else h + x
        return self.fc(F.relu(h).mean((2, 3)))


INPUT_LAYER_PRESETS = [
    ("lrp.w2", {}),
    ("lrp.flat", {}),
    ("lrp.zb", {"low": 0.0, "high": 1.0}),
    ("lrp.epsilon_gamma_box", {"low": 0.0, "high": 1.0}),
]


@pytest.mark.parametrize("join", ["add", "cat"])
@pytest.mark.parametrize(("method", "options"), INPUT_LAYER_PRESETS)
def test_input_layer_rules_refuse_an_input_that_also_passes_the_input_layer(join, method, options):
    # Their rules return the input's relevance, the other path a signal: the sum of the two at
    # the input was returned as relevance, which summed to neither the logit nor a map.
    torch.manual_seed(0)
    model = RawInputPastFirstLayer(join).double().eval()
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    before = state_fingerprint(model)
    joined = "add" if join == "add" else "cat"
    with pytest.raises(UnsupportedModelError, match=rf"on 'conv'.*operation '{joined}' in module"):
        explain(model, x, method, target=1, **options)
    assert_same_state(before, state_fingerprint(model))
    # a preset without an input-layer rule explains it: LRP-0 is Input×Gradient on a ReLU net
    torch.testing.assert_close(
        explain(model, x, "lrp.z", target=1).attribution, input_x_gradient(model, x, 1)
    )


class LSTMReadsInput(nn.Module):
    def __init__(self, head: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = self.lstm(x)[0][:, -1]
        return self.head(last) if self.head is not None else last[:, :3]


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize(("method", "options"), INPUT_LAYER_PRESETS)
def test_input_layer_rules_refuse_a_recurrent_layer_reading_the_input(head, method, options):
    # Without a Linear/Conv module the input-layer rule was dropped silently (lrp.w2 gave
    # lrp.zplus's map); with a head, the message blamed the head.
    model = LSTMReadsInput(head).eval()
    # named as written, not by the engine's own operations in it ('unbind')
    with pytest.raises(UnsupportedModelError, match=r": module 'lstm' \(LSTM\) reads it first"):
        explain(model, torch.rand(2, 5, 4), method, target=1, **options)


def input_x_gradient(model: nn.Module, x: torch.Tensor, target: int) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x)[:, target].sum(), x)
    return x.detach() * grad


class Tokens(nn.Module):
    """``Linear`` on ``(N, T, F)`` then ``BatchNorm1d(T)``, which normalises the token axis."""

    def __init__(self, tokens: int, hidden: int) -> None:
        super().__init__()
        self.fc, self.bn, self.out = (
            nn.Linear(5, hidden),
            nn.BatchNorm1d(tokens),
            nn.Linear(hidden, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.fc(x))).mean(1))


@pytest.mark.parametrize(("tokens", "hidden"), [(8, 8), (7, 8)])
def test_batchnorm_over_tokens_is_not_merged_into_the_linear_features(tokens, hidden):
    # Merging would scale the Linear's features by the tokens' statistics: wrong when the sizes
    # agree, a shape error when they do not. Kept apart it is a per-token affine layer.
    torch.manual_seed(0)
    model = Tokens(tokens, hidden).double()
    with torch.no_grad():
        model.bn.running_var.uniform_(0.3, 3.0)
        model.bn.running_mean.uniform_(-1.0, 1.0)
    model.eval()
    x = torch.randn(3, tokens, 5, dtype=torch.float64)
    got = explain(model, x, "lrp.z", target=0).attribution
    torch.testing.assert_close(got, input_x_gradient(model, x, 0))


def test_batchnorm_after_relu_gets_epsilon_in_the_presets_and_custom_rules_through_lrp_custom():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 16, 3),
    ).double()  # fmt: skip
    with torch.no_grad():
        model[2].running_mean.uniform_(-0.5, 0.5)
        model[2].running_var.uniform_(0.5, 2.0)
        model[2].weight.uniform_(-1.5, 1.5)  # negative scales too
    model.eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    # LRP-0 on the BatchNorm keeps LRP-0 = Input×Gradient
    torch.testing.assert_close(
        explain(model, x, "lrp.z", target=0).attribution, input_x_gradient(model, x, 0)
    )
    preset = explain(model, x, "lrp.epsilon_plus", target=0, epsilon=0.1).attribution
    spelled_out = composites.lrp_epsilon_plus(0.1).with_rules((nn.BatchNorm2d, Epsilon(0.1)))
    custom = explain(model, x, "lrp.custom", target=0, composite=spelled_out).attribution
    torch.testing.assert_close(preset, custom)
    # a rule of one's own for that module alone changes the map
    mine = composites.lrp_epsilon_plus(0.1).with_rules(("2", Epsilon(10.0)))
    other = explain(model, x, "lrp.custom", target=0, composite=mine).attribution
    assert not torch.allclose(other, preset)
    with pytest.raises(UnsupportedModelError, match=r"with_rules\(\(BatchNorm2d"):
        explain(model, x, "excitation_bp", target=0)
    with pytest.raises(ValueError, match=r"lrp\.custom needs composite="):
        explain(model, x, "lrp.custom", target=0)


def test_a_users_logging_hook_does_not_stop_or_change_the_explanation():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)
    ).eval()
    x = torch.randn(2, 3, 8, 8)
    expected = explain(model, x, "lrp.epsilon_plus", target=0).attribution
    seen = {}
    model[2].register_forward_hook(lambda m, i, o: seen.update(relu=o.detach(), norm=o.norm()))
    # a hook reading the convolution's output must not stop the BatchNorm merge
    model[0].register_forward_hook(lambda m, i, o: seen.update(conv=o.detach().abs().mean()))
    got = explain(model, x, "lrp.epsilon_plus", target=0).attribution
    torch.testing.assert_close(got, expected)
    assert seen["relu"].shape == (2, 4, 6, 6)
    # a detach on the way to the output is still refused
    blocked = nn.Sequential(model[0], nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)).eval()
    blocked[1].register_forward_hook(lambda m, i, o: o.detach())
    with pytest.raises(UnsupportedModelError, match="'detach'"):
        explain(blocked, x, "lrp.epsilon_plus", target=0)


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.probabilities = False
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.relu(self.fc1(x)))
        return out.softmax(1) if self.probabilities else out


class LowRank(nn.Linear):
    """A LoRA-style Linear: affine in its input only while ``up`` is zero."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.down = nn.Parameter(torch.randn(2, n_in))
        self.up = nn.Parameter(torch.zeros(n_out, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + F.relu(x @ self.down.T) @ self.up.T


def test_the_plan_cache_notices_flags_and_in_place_parameter_updates():
    clear_plan_cache()
    model, x = Flagged().eval(), torch.randn(2, 5)
    explain(model, x, "lrp.epsilon_plus", target=0)  # traced and cached
    model.probabilities = True
    with pytest.raises(UnsupportedModelError, match=r"'softmax'.*return the logits"):
        explain(model, x, "lrp.epsilon_plus", target=0)
    low_rank = nn.Sequential(LowRank(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.randn(4, 6)
    explain(low_rank, x, "lrp.z", target=0)  # up == 0: passes the affine check, cached
    with torch.no_grad():
        low_rank[0].up.normal_()  # an optimizer step, in place
    with pytest.raises(UnsupportedModelError, match="does not compute the affine map"):
        explain(low_rank, x, "lrp.z", target=0)


@pytest.mark.parametrize("pad", [nn.ReflectionPad2d, nn.ReplicationPad2d, nn.CircularPad2d])
def test_padding_modules_copy_relevance_and_padding_modes_name_them(pad):
    torch.manual_seed(0)
    model = nn.Sequential(
        pad(1), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 3)
    ).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(
        explain(model.eval(), x, "lrp.z", target=0).attribution, input_x_gradient(model, x, 0)
    )
    inline = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.Flatten())
    with pytest.raises(UnsupportedModelError, match="ReflectionPad"):
        explain(inline.double().eval(), x, "lrp.epsilon", target=0)


def _padded_net(pad: nn.Module | None, inner_padding: int = 0) -> nn.Sequential:
    """A convolution net with its padding as a module before it (or in the convolution)."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=inner_padding), nn.ReLU(), nn.Flatten()]
    layers.append(nn.Linear(4 * 36, 3))
    return nn.Sequential(*([pad] if pad is not None else []), *layers).double().eval()


def _sample_bounds() -> torch.Tensor:
    low = torch.zeros(3, 6, 6, dtype=torch.float64)
    low[1] = -0.5  # one channel has another range: a bound that must not be moved elsewhere
    return low


@pytest.mark.parametrize("pad", [nn.ZeroPad2d(1), nn.ConstantPad2d(1, 0.0)])
@pytest.mark.parametrize(
    ("method", "options"),
    [*INPUT_LAYER_PRESETS, ("lrp.zb", {"low": _sample_bounds(), "high": 1.0})],
)
def test_input_layer_rules_read_zero_padding_before_the_layer_as_the_layers_own(
    pad, method, options
):
    # Refused before (padding read the input first), also where the refusal of a convolution's
    # padding_mode advises a padding module. Zero padding is no input, as in the convolution.
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    padded = explain(_padded_net(pad), x, method, target=1, **options).attribution
    inner = explain(_padded_net(None, inner_padding=1), x, method, target=1, **options)
    torch.testing.assert_close(padded, inner.attribution, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("pad", [nn.ReflectionPad2d, nn.ReplicationPad2d, nn.CircularPad2d])
@pytest.mark.parametrize(
    ("method", "options"),
    [("lrp.w2", {}), ("lrp.flat", {}), ("lrp.zb", {"low": _sample_bounds(), "high": 1.0})],
)
def test_input_layer_rules_give_padded_copies_relevance_back_to_their_sources(pad, method, options):
    # The reference: the layers after the padding explained on the padded input (bounds padded
    # alike), each copy's relevance then added to the value it copies (the padding's transpose).
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    model = _padded_net(pad(1))
    got = explain(model, x, method, target=1, **options).attribution
    inner = nn.Sequential(*list(model)[1:]).eval()
    padding = model[0]
    on_padded = dict(options)
    if "low" in options:
        on_padded["low"] = padding(options["low"][None].expand(2, -1, -1, -1))
    relevance = explain(inner, padding(x), method, target=1, **on_padded).attribution
    source = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(padding(source), source, relevance)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


class ChannelsLastDense(nn.Module):
    """A dense layer on each pixel's channels, after permuting them last."""

    def __init__(self) -> None:
        super().__init__()
        self.pixel, self.head = nn.Linear(3, 4), nn.Linear(4 * 2 * 5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.pixel(x.permute(0, 2, 3, 1))).flatten(1))


def test_zb_bounds_shaped_like_a_sample_follow_the_models_permutation():
    # They were reshaped to the layer's input, not permuted: channel 0's bound went elsewhere
    torch.manual_seed(0)
    model = ChannelsLastDense().double().eval()
    x = torch.rand(2, 3, 2, 5, dtype=torch.float64)
    low, high = torch.zeros(3, 2, 5, dtype=torch.float64), torch.ones(3, 2, 5, dtype=torch.float64)
    low[0] = -1.0
    got = explain(model, x, "lrp.zb", 1, low=low, high=high).attribution
    permuted = nn.Sequential(model.pixel, nn.ReLU(), nn.Flatten(), model.head).eval()
    expected = explain(
        permuted,
        x.permute(0, 2, 3, 1),
        "lrp.zb",
        1,
        low=low.permute(1, 2, 0),
        high=high.permute(1, 2, 0),
    ).attribution
    torch.testing.assert_close(got, expected.permute(0, 3, 1, 2), rtol=1e-12, atol=1e-15)
    # as many values in another layout are refused, not reshaped into the input's
    with pytest.raises(InvalidInputError, match=r"bound low of shape \(2, 5, 3\) does not fit"):
        explain(model, x, "lrp.zb", 1, low=low.permute(1, 2, 0), high=high)


class Unusual(nn.Module):
    def __init__(self, pooling: str) -> None:
        super().__init__()
        self.pooling = pooling
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))
        if self.pooling == "amax":
            h = h.amax((2, 3))
        elif self.pooling == "max pooling":
            h = F.adaptive_max_pool2d(h, 1).flatten(1)
        elif self.pooling == "clamp":
            h = h.clamp(min=0.1).mean((2, 3))
        else:
            h = h.mean((2, 3))
        return self.fc(torch.cat([h, torch.zeros_like(h)], 1))


def test_value_free_operations_pass_and_unsupported_ones_suggest_a_rewrite():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    model = Unusual("mean").double().eval()
    torch.testing.assert_close(
        explain(model, x, "lrp.z", target=1).attribution, input_x_gradient(model, x, 1)
    )
    torch.manual_seed(0)
    amax, pooled = Unusual("amax").double().eval(), Unusual("max pooling").double().eval()
    pooled.load_state_dict(amax.state_dict())
    torch.testing.assert_close(  # a maximum over dimensions is max pooling over them
        explain(amax, x, "lrp.z", target=1).attribution,
        explain(pooled, x, "lrp.z", target=1).attribution,
    )
    with pytest.raises(UnsupportedModelError, match=r"for clamp\(min=0\) use F.relu"):
        explain(Unusual("clamp").double().eval(), x, "lrp.z", target=1)


def test_gradient_rule_for_one_module_through_lrp_custom_equals_the_gradient_there():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    everywhere = composites.lrp_z().with_rules(("0", Gradient()), ("2", Gradient()))
    got = explain(model, x, "lrp.custom", target=0, composite=everywhere).attribution
    torch.testing.assert_close(got, input_x_gradient(model, x, 0))


class Overwritten(nn.Module):
    """Writes into an activation: ``h[:, 0] = -1`` (setitem) or ``h[:, :2].sub_(1)`` (a view)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x)).clone()
        if self.how == "setitem":
            h[:, 0] = -1.0
        else:
            h[:, :2].sub_(1.0)
        return self.fc3(F.relu(self.fc2(h)))

    def reference(self, x: torch.Tensor, target: int) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        y = h.clone()
        if self.how == "setitem":
            y[:, 0] = -1.0
        else:
            y[:, :2] -= 1.0
        a = F.relu(self.fc2(y))
        out = self.fc3(a)
        relevance = zplus_reference(a, self.fc3.weight, logit_relevance(out, target))
        relevance = zplus_reference(y, self.fc2.weight, relevance)
        if self.how == "setitem":
            relevance[:, 0] = 0.0  # a constant took h's place: no relevance reaches h there
        else:
            relevance = split_by_value(h, y, relevance)
        return zplus_reference(x, self.fc1.weight, relevance)


class Branching(Shifted):
    """Shifts only if some input in the batch is large: Python control flow on tensor values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if x.amax() > 1.0:
            h = h + self.shift
        return self.fc3(F.relu(self.fc2(h)))


@pytest.mark.parametrize("how", ["setitem", "view"])
def test_writes_into_activations_are_seen(how):
    # h[:, 0] = -1 returns None and h[:, :2].sub_(1) changes h through a view: either makes h
    # signed, which z⁺ must see; a blocked operation written in this way must still be refused.
    torch.manual_seed(0)
    model = Overwritten(how).double().eval()
    x = torch.randn(5, 6, dtype=torch.float64)
    got = explain(model, x, "lrp.zplus", target=1).attribution
    with torch.no_grad():
        torch.testing.assert_close(got, model.reference(x, 1))


def test_blocked_operations_written_into_an_activation_are_refused():
    class Squares(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.fc1(x)).clone()
            h[:, 0] = h[:, 1].clone() * h[:, 2].clone()
            return self.fc2(h)

    with pytest.raises(UnsupportedModelError, match=r"multiplies (or divides )?two input-dep"):
        explain(Squares().eval(), torch.randn(3, 6), "lrp.z", target=0)


def test_branches_on_values_are_traced_on_the_whole_batch_and_not_cached():
    clear_plan_cache()
    torch.manual_seed(0)
    model = Branching().double().eval()
    x = torch.randn(5, 6, dtype=torch.float64).clamp(-0.9, 0.9)
    x[3, 2] = 1.5  # only a later sample takes the branch
    got = explain(model, x, "lrp.zplus", target=1).attribution
    with torch.no_grad():
        torch.testing.assert_close(got, Shifted.reference(model, x, 1))
    calm = x.clamp(-0.9, 0.9)  # now no sample takes it: a cached plan would still expect it
    shifted = explain(model, calm, "lrp.zplus", target=1).attribution
    plain = nn.Sequential(model.fc1, nn.ReLU(), model.fc2, nn.ReLU(), model.fc3).eval()
    torch.testing.assert_close(shifted, explain(plain, calm, "lrp.zplus", target=1).attribution)


class Mode(enum.Enum):
    PLAIN = "plain"
    SHIFTED = "shifted"


@dataclasses.dataclass
class Options:
    shift: bool = False


class Config:
    """A configuration object of a plain class, as Hugging Face models keep one."""

    def __init__(self) -> None:
        self.shift = False


class Configurable(Shifted):
    """Reads a setting of one kind or another in forward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mode, self.options, self.flags, self.config = Mode.PLAIN, Options(), [], Config()
        self.table, self.act = {"shift": False}, F.relu
        self.flag = torch.tensor(False)

    def shifting(self) -> bool:
        return {
            "enum": self.mode is Mode.SHIFTED,
            "dataclass": self.options.shift,
            "object": self.config.shift,
            "list": bool(self.flags),
            "dict": self.table["shift"],
            "tensor": bool(self.flag),
            "function": self.act is not F.relu,
        }[self.kind]

    def toggle(self) -> None:
        """Change the setting of this model's kind, and no other."""
        if self.kind == "enum":
            self.mode = Mode.SHIFTED
        elif self.kind == "dataclass":
            self.options.shift = True
        elif self.kind == "object":
            self.config.shift = True
        elif self.kind == "list":
            self.flags.append("shift")
        elif self.kind == "dict":
            self.table["shift"] = True
        elif self.kind == "tensor":
            self.flag.fill_(True)
        else:
            self.act = F.relu6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if self.shifting():
            h = h + self.shift
        return self.fc3(F.relu(self.fc2(h)))


@pytest.mark.parametrize(
    "kind", ["enum", "dataclass", "object", "list", "dict", "tensor", "function"]
)
def test_the_plan_cache_sees_settings_of_every_common_kind(kind):
    # "object": a flag of a config object was not seen, and the stale plan skipped checks
    clear_plan_cache()
    torch.manual_seed(0)
    model = Configurable(kind).double().eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    explain(model, x, "lrp.zplus", target=1)  # cached with the setting off
    model.toggle()
    got = explain(model, x, "lrp.zplus", target=1).attribution
    with torch.no_grad():
        torch.testing.assert_close(got, Shifted.reference(model, x, 1))


@pytest.mark.parametrize("cut", ["all", "one branch", "one module"])
def test_a_no_grad_block_in_forward_is_a_clear_error(cut):
    # Cutting one of two branches would silently lose that branch's relevance.
    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.side, self.fc2 = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                h = self.fc1(x) if cut == "one module" else F.relu(self.fc1(x))
            if cut != "all":
                h = h + self.side(x)
            return self.fc2(h)

    model = Frozen().eval()
    before = state_fingerprint(model)
    with pytest.raises(UnsupportedModelError, match=r"'fc1' \(Linear\) runs under torch\.no_grad"):
        explain(model, torch.randn(3, 6), "lrp.epsilon", target=0)
    assert_same_state(before, state_fingerprint(model))


@pytest.mark.parametrize("prop", ["T", "data"])
def test_tensor_properties_are_operations_of_their_own(prop):
    class Property(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.fc1(x))
            return self.fc2(h.T.T if prop == "T" else h.data)

    torch.manual_seed(0)
    model = Property().double().eval()
    x = torch.randn(3, 6, dtype=torch.float64)
    if prop == "T":  # a transpose: linear, LRP-0 stays Input×Gradient
        got = explain(model, x, "lrp.z", target=0).attribution
        torch.testing.assert_close(got, input_x_gradient(model, x, 0))
    else:
        with pytest.raises(UnsupportedModelError, match=r"'data'.*not \.data"):
            explain(model, x, "lrp.z", target=0)


class _ClampFunction(torch.autograd.Function):
    """A user's own ReLU as a custom autograd Function."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x > 0)


def _logged(forward):
    @functools.wraps(forward)
    def wrapper(*args):
        return forward(*args)

    return wrapper


class _SetupContextClamp(torch.autograd.Function):
    """A forward without ``ctx`` (``setup_context`` style), decorated as AMP's custom_fwd does."""

    @staticmethod
    @_logged
    def forward(x):
        return x.clamp(min=0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x > 0)


def test_a_custom_function_is_found_from_the_code_of_its_forward():
    """torch 2.14 runs ``Function.apply`` in C, so no Python frame names the Function: the engine
    finds it from the running forward's code, also through a decorator."""
    from explain_core.engine.tracing import _function_with_forward

    assert _function_with_forward(_ClampFunction.forward.__code__) is _ClampFunction
    inner = _SetupContextClamp.forward.__wrapped__.__code__
    assert _function_with_forward(inner) is _SetupContextClamp
    assert _function_with_forward(_logged.__code__) is None


class _FunctionReLU(nn.ReLU):
    def forward(self, x):
        return _ClampFunction.apply(x)


class _FunctionInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return _ClampFunction.apply(self.linear(x))


def test_a_custom_autograd_function_is_named_with_advice_that_works():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double().eval()
    custom = nn.Sequential(plain[0], _FunctionReLU(), plain[2]).eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError) as caught:
        explain(custom, x, "lrp.epsilon", 1)
    message = str(caught.value)
    assert "custom autograd Function _ClampFunction called in module '1' (_FunctionReLU)" in message
    assert "Give module '1' a rule in the composite" in message  # a leaf: no new module needed
    assert "torch.no_grad" not in message
    # The advice followed: a pass-through rule for the module gives LRP-ε of the plain ReLU net.
    from explain_modbp.activations import PassRelevance

    ruled = composites.lrp_epsilon().with_rules((_FunctionReLU, PassRelevance()))
    followed = explain(custom, x, "lrp.custom", 1, composite=ruled)
    expected = explain(plain, x, "lrp.epsilon", 1)
    torch.testing.assert_close(followed.attribution, expected.attribution, rtol=1e-12, atol=1e-12)
    # Inside a module that does more, the Function must first get a module of its own.
    nested = nn.Sequential(_FunctionInside(), nn.Linear(4, 3)).eval()
    with pytest.raises(UnsupportedModelError, match=r"in module '0' .*module of its own"):
        explain(nested, torch.randn(2, 4), "lrp.epsilon", 1)


class _Checkpointed(nn.Module):
    """Activation checkpointing as training code writes it (torch.utils.checkpoint)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 5), nn.ReLU())
        self.head = nn.Linear(5, 3)
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant is None:
            return self.head(self.block(x))
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: "none of the inputs have requires_grad"
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_is_named_with_the_way_out(reentrant):
    torch.manual_seed(0)
    model = _Checkpointed(reentrant).eval()
    x = torch.randn(3, 4)
    for method in ("lrp.epsilon", "deeplift.rescale", "guided_bp"):
        # the non-reentrant kind would fail in some rules and silently run in others: refused
        with pytest.raises(UnsupportedModelError, match=r"module 'block' .*activation checkpoint"):
            explain(model, x, method, 1)
    plain = _Checkpointed(None).eval()
    plain.load_state_dict(model.state_dict())
    if reentrant:  # torch refuses input gradients through it
        with pytest.raises(InvalidInputError, match=r"gradient_checkpointing_disable\(\)"):
            explain(model, x, "gradient", 1)
    else:  # plain autograd through the recomputation is exact
        torch.testing.assert_close(
            explain(model, x, "gradient", 1).attribution,
            explain(plain, x, "gradient", 1).attribution,
        )
    plain_map = explain(plain, x, "lrp.epsilon", 1).attribution  # the way out: no checkpointing
    assert plain_map.abs().sum() > 0


class _ResidualCNN(nn.Module):
    """A small residual CNN written so that TorchScript and torch.export both take it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv1(x)))
        h = F.relu(self.conv2(h)) + h
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # deprecated in torch 2.13
@pytest.mark.parametrize("compile_with", ["script", "trace"])
def test_torchscript_is_refused_by_name_and_explained_by_the_gradient_methods(compile_with):
    # TorchScript runs its operations in its own interpreter: the trace saw none of them and
    # blamed the model's output ("does not depend on its input through operations ...").
    torch.manual_seed(0)
    model, x = _ResidualCNN().eval(), torch.rand(2, 3, 6, 6)
    scripted = torch.jit.script(model) if compile_with == "script" else torch.jit.trace(model, x)
    for method in ("lrp.epsilon_plus", "deeplift.rescale", "guided_bp"):
        with pytest.raises(UnsupportedModelError, match=r"'<root>' \(\w+\) is TorchScript"):
            explain(scripted, x, method, target=1)
    wrapped = nn.Sequential(scripted, nn.ReLU())  # a TorchScript submodule: named by its path
    with pytest.raises(UnsupportedModelError, match=r"module '0' \(\w+\) is TorchScript"):
        explain(wrapped, x, "lrp.epsilon", target=1)
    for method in ("gradient", "integrated_gradients"):
        expected = explain(model, x, method, target=1).attribution
        torch.testing.assert_close(explain(scripted, x, method, target=1).attribution, expected)


def test_an_exported_program_is_refused_by_the_rules_and_its_batch_guard_explained():
    torch.manual_seed(0)
    model, x = _ResidualCNN().eval(), torch.rand(2, 3, 6, 6)
    fixed = torch.export.export(model, (x,)).module()  # checks the batch size it was made with
    with pytest.raises(UnsupportedModelError, match=r"runs ATen operations.*torch\.export"):
        explain(fixed, x, "lrp.epsilon_plus", target=1)
    with pytest.raises(
        InvalidInputError, match=r"not on a batch of 1.*Guard failed.*dynamic_shapes"
    ):
        explain(fixed, x, "integrated_gradients", target=1)
    dynamic = {"x": {0: torch.export.Dim("batch")}}
    exported = torch.export.export(model, (x,), dynamic_shapes=dynamic).module()
    expected = explain(model, x, "integrated_gradients", target=1).attribution
    torch.testing.assert_close(
        explain(exported, x, "integrated_gradients", target=1).attribution, expected
    )


class Probabilities(nn.Module):
    """A ReLU net whose output is made from softmax probabilities, as ``form`` says."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 5)
        self.softmax = nn.Softmax(1)  # the usual attribute name: also an operation's name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(F.relu(self.conv(x)).mean((2, 3)))
        p = self.softmax(z)
        if self.form == "reshaped":
            return p.unflatten(1, (5, 1)).flatten(1)
        if self.form == "sliced":
            return p[:, :4]
        if self.form == "percent":
            return 100 * p
        if self.form == "averaged":
            return (p + F.softmax(2 * z, 1)) / 2
        return p


@pytest.mark.parametrize("form", ["plain", "reshaped", "sliced", "percent", "averaged"])
def test_an_output_a_held_softmax_cuts_off_from_the_input_is_refused(form):
    # CP-LRP holds every softmax constant: on probabilities it gave an all-zero map, silently.
    torch.manual_seed(0)
    model = Probabilities(form).double().eval()
    x = torch.rand(2, 3, 8, 8, dtype=torch.float64)
    before = state_fingerprint(model)
    softmax = r"operation 'softmax' in module '(softmax|<root>)' \((Softmax|Probabilities)\)"
    refusal = rf"passes {softmax}, which the composite 'lrp.cp' holds constant.*logits"
    with pytest.raises(UnsupportedModelError, match=refusal):
        explain(model, x, "lrp.cp", target=1)
    assert_same_state(before, state_fingerprint(model))
    # AttnLRP's softmax rule is the gradient: on a ReLU net, Input×Gradient of the output
    attn = explain(model, x, "lrp.attn", target=1).attribution
    torch.testing.assert_close(attn, input_x_gradient(model, x, 1))


def test_a_model_returning_a_tuple_is_told_to_return_one_tensor():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.fc(x), x

    for method in ("lrp.epsilon", "lrp.cp", "deeplift.rescale"):
        with pytest.raises(InvalidInputError, match=r"returned a tuple; wrap it .*model\(x\)\[0\]"):
            explain(Pair().eval(), torch.rand(2, 4), method, target=1)


class MaskedMean(nn.Module):
    """Mean pooling over the steps that are not zero padding, the mask computed from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(3, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            mask = (x != 0).any(-1, keepdim=True).to(x.dtype)
        return self.head((F.relu(self.embed(x)) * mask).sum(1) / mask.sum(1))


def _padded_steps() -> torch.Tensor:
    x = torch.randn(3, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[1, 5:], x[2, 3:] = 0, 0
    return x


@pytest.mark.parametrize(
    "method", ["lrp.epsilon", "lrp.epsilon_plus", "lrp.attn", "guided_bp", "excitation_bp"]
)
def test_a_mask_of_the_input_is_a_constant_as_if_passed_as_given(method):
    # Refused by every rule-based method before ('ne' has no rule), though nothing flows
    # through it: the reference is the same model with the mask passed as an input, held
    torch.manual_seed(0)
    model, x = MaskedMean().double().eval(), _padded_steps()
    mask = (x != 0).any(-1, keepdim=True).double()
    got = explain(model, x, method, 1).attribution
    held = explain_inputs(model, {"x": x, "mask": mask}, method, 1, explained="x").attribution
    torch.testing.assert_close(got, held, rtol=0, atol=0)


def test_deeplift_refuses_a_mask_of_the_input_and_its_advice_sums_to_the_difference():
    # The reference's mask differs (all steps padding at x0 = 0): DeepLIFT would explain it too
    torch.manual_seed(0)
    model, x = MaskedMean().double().eval(), _padded_steps()
    with pytest.raises(UnsupportedModelError, match=r"'ne' in module '<root>'.*explain_inputs\("):
        explain(model, x, "deeplift.rescale", 1)
    mask = (x != 0).any(-1, keepdim=True).double()
    result = explain_inputs(model, {"x": x, "mask": mask}, "deeplift.rescale", 1, explained="x")
    with torch.no_grad():
        difference = model(x, mask)[:, 1] - model(torch.zeros_like(x), mask)[:, 1]
    torch.testing.assert_close(result.attribution.sum((1, 2)), difference)


class HandWrittenReLU(nn.Module):
    """``h * (h > 0)`` of a hidden activation, or of a parameter-free function of the input."""

    def __init__(self, hidden: bool) -> None:
        super().__init__()
        self.hidden = nn.Linear(3, 3) if hidden else None
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x) if self.hidden is not None else x - 0.5
        return self.head(h * (h > 0))


@pytest.mark.parametrize("hidden", [True, False])
@pytest.mark.parametrize("method", ["guided_bp", "deeplift.rescale", "lrp.epsilon"])
def test_an_activation_written_with_a_comparison_stays_refused(hidden, method):
    # Guided BP would silently take the gradient there (taken for a mask of the input's padding)
    model = HandWrittenReLU(hidden).eval()
    with pytest.raises(UnsupportedModelError, match=r"operation 'gt'.*comparison of activations"):
        explain(model, torch.randn(2, 3), method, 1)


def test_a_softmax_module_inside_the_model_is_not_called_its_last_layer():
    # the advice was to leave out "its final Softmax2d" with model[:-1], which drops the head
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Softmax2d(), nn.Conv2d(4, 2, 1), nn.Flatten())
    with pytest.raises(UnsupportedModelError) as refused:
        explain(model.eval(), torch.rand(2, 3, 2, 2), "lrp.epsilon", target=1)
    message = str(refused.value)
    assert "If it is the model's last layer" in message
    assert "composite.with_rules((Softmax2d, MyRule()))" in message


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNorm fused with its activation (EfficientNet, MobileNetV3, RegNet, CSPNet)."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.drop, self.act = nn.Identity(), nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )
        return self.act(self.drop(x))


def test_a_batchnorm_fused_with_its_activation_is_refused_by_what_it_runs():
    # The refusal guessed "weight standardisation?" for timm's BatchNormAct2d, and its only
    # advice was a rule of one's own for it: it names the fused submodules and how to split them
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), BatchNormAct2d(4), nn.Flatten(), nn.Linear(4 * 36, 3)
    ).eval()
    with pytest.raises(UnsupportedModelError) as error:
        explain(model, torch.rand(2, 3, 8, 8), "lrp.epsilon", target=0)
    message = str(error.value)
    assert "module '1' (BatchNormAct2d)" in message
    assert "'drop' (Identity), 'act' (Hardswish)" in message and "nn.Sequential" in message
    assert "weight standardisation" not in message
