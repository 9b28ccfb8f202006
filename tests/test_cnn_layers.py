"""Layers of today's CNNs in the LRP presets, each against an independent float64 reference.

The references are the same models with the rule's assumption written into the code: the
squeeze-excitation gate and the normalisations' scales are constants (computed from the same
inputs beforehand, so that they are not input-dependent in the explained pass), and bilinear
resampling is written out as weighted sums of shifted copies. The presets must give the same
maps on the models as users write them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import StochasticDepth

from explain_core import UnsupportedModelError, explain

PRESETS = ["lrp.epsilon", "lrp.z", "lrp.epsilon_plus", "lrp.zplus", "lrp.gamma", "lrp.alpha2beta1"]


class SqueezeExcitation(nn.Module):
    """torchvision's block: ``x ⊙ gate(pool(x))`` (sigmoid or hard sigmoid gate)."""

    def __init__(self, channels: int, gate: nn.Module, signal: nn.Module | None = None) -> None:
        super().__init__()
        self.signal = signal or nn.Identity()  # EfficientNet's SiLU, MobileNetV3's Hardswish
        self.fc1 = nn.Conv2d(channels, 3, 1)
        self.fc2 = nn.Conv2d(3, channels, 1)
        self.gate = gate

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.signal(x)
        return x * self.scale(x)


class ConstantGate(nn.Module):
    """The reference: ``x ⊙ g`` with the gate values ``g`` a constant."""

    def __init__(self, block: SqueezeExcitation) -> None:
        super().__init__()
        self.block = block
        self.constant: torch.Tensor | None = None

    def compute(self, h: torch.Tensor) -> None:
        self.constant = self.block.scale(self.block.signal(h)).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the engine traces on the batch's first samples
        return self.block.signal(x) * self.constant[: len(x)]


class Body(nn.Module):
    """conv → ReLU → the layer under test → conv → pooling → linear."""

    def __init__(self, layer: nn.Module, bias: bool = True, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, channels, 3, padding=1, bias=bias)
        self.layer = layer
        self.conv2 = nn.Conv2d(channels, 4, 3, padding=1, bias=bias)
        self.head = nn.Linear(4, 3, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(self.layer(F.relu(self.conv1(x))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(F.relu(h), 1), 1))


def twins(layer: nn.Module, reference_layer: nn.Module, bias: bool = True) -> tuple[Body, Body]:
    """The model and its reference, sharing every weight (the reference wraps ``layer``)."""
    torch.manual_seed(0)
    model = Body(layer, bias).double().eval()
    reference = Body(reference_layer, bias).double().eval()
    for name in ("conv1", "conv2", "head"):
        getattr(reference, name).load_state_dict(getattr(model, name).state_dict())
    return model, reference


def images(batch: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch, 2, 6, 6, dtype=torch.float64, generator=generator)


def assert_same_maps(model: Body, reference: Body, method: str) -> None:
    x = images()
    if hasattr(reference.layer, "compute"):  # its constants, from the layer's real input
        with torch.no_grad():
            reference.layer.compute(F.relu(model.conv1(x)))
    got = explain(model, x, method, 1).attribution
    expected = explain(reference, x, method, 1).attribution
    assert expected.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


# --- squeeze-excitation: the gate held constant, all relevance to the signal ----------------


@pytest.mark.parametrize(
    ("gate", "signal"),
    [
        (nn.Sigmoid, None),
        (nn.Hardsigmoid, None),
        (nn.Sigmoid, nn.SiLU),
        (nn.Hardsigmoid, nn.Hardswish),
    ],
    ids=["sigmoid", "hardsigmoid", "efficientnet", "mobilenet_v3"],
)
@pytest.mark.parametrize("method", PRESETS)
def test_squeeze_excitation_holds_the_gate_constant(gate, signal, method):
    # the signal may come from an activation too: the sigmoid-like factor is the gate
    torch.manual_seed(2)
    block = SqueezeExcitation(4, gate(), signal and signal()).double()
    model, reference = twins(block, ConstantGate(block))
    assert_same_maps(model, reference, method)


class ShapedSqueezeExcitation(SqueezeExcitation):
    """The gate as repositories shape it before the product: the same values, other operations.

    ``view``: SENet's ``y.view(b, c, 1, 1)`` and ``x * y.expand_as(x)``; ``index``:
    ``y[:, :, None, None]``; ``hard_sigmoid``: MobileNetV3 ports' ``relu6(s + 3) / 6``.
    """

    def __init__(self, shape: str) -> None:
        gate = nn.Identity() if shape == "hard_sigmoid" else nn.Sigmoid()
        super().__init__(4, gate)
        self.shape = shape

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        y = super().scale(x)
        if self.shape == "hard_sigmoid":
            return F.relu6(y + 3) / 6
        y = y.flatten(1)
        if self.shape == "index":
            return y[:, :, None, None]
        return y.view(*y.shape, 1, 1).expand_as(x)


@pytest.mark.parametrize(
    ("shape", "method"),
    [
        (shape, method)
        for shape in ("view", "index", "hard_sigmoid")
        for method in (*PRESETS, "lrp.attn", "lrp.cp")
        # AttnLRP holds sigmoid-like gates only: a ReLU6 made into one is split uniformly
        if (shape, method) != ("hard_sigmoid", "lrp.attn")
    ],
)
def test_a_gate_reshaped_or_scaled_before_the_product_is_still_the_gate(shape, method):
    # Only a product reading the sigmoid's output itself was told from one without a gate;
    # the others were refused.
    torch.manual_seed(2)
    block = ShapedSqueezeExcitation(shape).double()
    model, reference = twins(block, ConstantGate(block))
    assert_same_maps(model, reference, method)


def test_squeeze_excitation_conserves_on_a_bias_free_signal_path():
    # The gate's own convolutions keep their biases: the gate gets no relevance at all.
    torch.manual_seed(0)
    model = Body(SqueezeExcitation(4, nn.Sigmoid()), bias=False).double().eval()
    result = explain(model, images(), "lrp.z", 2)
    torch.testing.assert_close(
        result.delta, torch.zeros(3, dtype=torch.float64), atol=1e-10, rtol=0
    )


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def test_a_product_without_a_gate_is_refused_with_the_way_out():
    torch.manual_seed(0)
    model = Body(Square()).double().eval()
    with pytest.raises(UnsupportedModelError, match=r"'mul' multiplies two input-dependent") as e:
        explain(model, images(), "lrp.epsilon", 1)
    assert str(e.value).endswith("(in module 'layer' (Square))")  # where, as every refusal says


# --- normalisations: the scale held constant ---------------------------------------------------


class ConstantScaleGroupNorm(nn.Module):
    """``γ ⊙ (x − μ_g)/σ_g + β`` with σ_g a constant: the rule's assumption written out."""

    def __init__(self, norm: nn.GroupNorm) -> None:
        super().__init__()
        self.norm = norm
        self.sigma: torch.Tensor | None = None

    def compute(self, h: torch.Tensor) -> None:
        grouped = h.reshape(h.shape[0], self.norm.num_groups, -1)
        self.sigma = torch.sqrt(grouped.var(2, unbiased=False, keepdim=True) + self.norm.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.reshape(x.shape[0], self.norm.num_groups, -1)
        centred = grouped - grouped.mean(2, keepdim=True)
        normalised = (centred / self.sigma[: len(x)]).reshape(x.shape)
        shape = (1, -1, 1, 1)
        return normalised * self.norm.weight.reshape(shape) + self.norm.bias.reshape(shape)


class ChannelsLastLayerNorm(nn.Module):
    """ConvNeXt's LayerNorm over channels: permute, normalise the last axis, permute back."""

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConstantScaleLayerNorm(ChannelsLastLayerNorm):
    def compute(self, h: torch.Tensor) -> None:
        h = h.permute(0, 2, 3, 1)
        self.sigma = torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + self.norm.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.permute(0, 2, 3, 1)
        sigma = self.sigma[: len(x)]
        out = (h - h.mean(-1, keepdim=True)) / sigma * self.norm.weight + self.norm.bias
        return out.permute(0, 3, 1, 2)


def _affine(norm: nn.Module) -> nn.Module:
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    return norm.double()


@pytest.mark.parametrize("groups", [1, 2, 4])  # LayerNorm-like, grouped, InstanceNorm-like
@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.epsilon_plus", "lrp.gamma"])
def test_group_norm_holds_its_scale_constant(groups, method):
    torch.manual_seed(3)
    norm = _affine(nn.GroupNorm(groups, 4))
    model, reference = twins(norm, ConstantScaleGroupNorm(norm))
    assert_same_maps(model, reference, method)


@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.zplus"])
def test_layer_norm_over_channels_holds_its_scale_constant(method):
    torch.manual_seed(3)
    norm = _affine(nn.LayerNorm(4))
    model, reference = twins(ChannelsLastLayerNorm(norm), ConstantScaleLayerNorm(norm))
    assert_same_maps(model, reference, method)


@pytest.mark.parametrize(
    ("layer", "op"),
    [
        (lambda: _affine(nn.GroupNorm(2, 4)), "group_norm"),
        (lambda: ChannelsLastLayerNorm(_affine(nn.LayerNorm(4))), "layer_norm"),
        (lambda: SqueezeExcitation(4, nn.Sigmoid()), "mul"),
    ],
    ids=["group_norm", "layer_norm", "squeeze_excitation"],
)
@pytest.mark.parametrize("method", ["deeplift.rescale", "deeplift.reveal_cancel"])
def test_methods_without_rules_for_norms_and_gates_point_to_the_lrp_composites(layer, op, method):
    # The advice was AttnLRP's for a transformer, also for a ConvNeXt's LayerNorm or an SE gate.
    torch.manual_seed(0)
    model = Body(layer()).double().eval()
    with pytest.raises(UnsupportedModelError, match=rf"'{op}'.*The LRP composites give") as e:
        explain(model, images(), method, 1)
    assert "For an attention model (a transformer)" not in str(e.value)
    explain(model, images(), "lrp.epsilon", 1)  # which they do


class RunningAffine(nn.Module):
    """An eval-mode InstanceNorm with running statistics, as the affine map it is."""

    def __init__(self, norm: nn.InstanceNorm2d) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm, shape = self.norm, (1, -1, 1, 1)
        scale = (norm.weight / torch.sqrt(norm.running_var + norm.eps)).reshape(shape)
        return (x - norm.running_mean.reshape(shape)) * scale + norm.bias.reshape(shape)


@pytest.mark.parametrize("running", [False, True])
def test_instance_norm_per_sample_or_with_running_statistics(running):
    torch.manual_seed(4)
    norm = _affine(nn.InstanceNorm2d(4, affine=True, track_running_stats=running))
    if running:
        with torch.no_grad():
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
    norm.eval()
    per_channel = nn.GroupNorm(4, 4).double()  # one group per channel: InstanceNorm's statistics
    per_channel.load_state_dict({"weight": norm.weight, "bias": norm.bias})
    model, reference = twins(
        norm, RunningAffine(norm) if running else ConstantScaleGroupNorm(per_channel)
    )
    assert_same_maps(model, reference, "lrp.epsilon")


# --- resampling: a constant linear map ---------------------------------------------------------


def _interleave(even: torch.Tensor, odd: torch.Tensor, dim: int) -> torch.Tensor:
    stacked = torch.stack([even, odd], dim=dim + 1)
    shape = list(even.shape)
    shape[dim] *= 2
    return stacked.reshape(shape)


def _double(x: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
    """Upsampling by 2 along ``dim``, written out (align_corners=False)."""
    if mode == "nearest":
        return _interleave(x, x, dim)
    n = x.shape[dim]
    left = torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 0, n - 1)], dim)  # x[i-1], clamped
    right = torch.cat([x.narrow(dim, 1, n - 1), x.narrow(dim, n - 1, 1)], dim)  # x[i+1]
    return _interleave(0.25 * left + 0.75 * x, 0.75 * x + 0.25 * right, dim)


class Resample(nn.Module):
    def __init__(self, mode: str, written_out: bool = False) -> None:
        super().__init__()
        self.mode = mode
        self.written_out = written_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.written_out:
            return _double(_double(x, 2, self.mode), 3, self.mode)
        options = {} if self.mode == "nearest" else {"align_corners": False}
        return F.interpolate(x, scale_factor=2, mode=self.mode, **options)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.zplus", "deeplift.rescale", "guided_bp"])
def test_interpolation_is_a_constant_linear_map(mode, method):
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)  # the reference is F.interpolate, written out
    torch.testing.assert_close(Resample(mode, written_out=True)(x), Resample(mode)(x))
    model, reference = twins(Resample(mode), Resample(mode, written_out=True))
    assert_same_maps(model, reference, method)


def test_upsample_module_and_conservation():
    torch.manual_seed(0)
    model = Body(nn.Upsample(scale_factor=2, mode="bilinear"), bias=False).double().eval()
    result = explain(model, images(), "lrp.z", 0)
    torch.testing.assert_close(
        result.delta, torch.zeros(3, dtype=torch.float64), atol=1e-10, rtol=0
    )


# --- transposed convolutions: a convolution of the input with zeros inserted ------------------


class ZeroInsertedConv(nn.Module):
    """``ConvTranspose(x)`` as a convolution: zeros between the inputs, padding, flipped kernel.

    Zeros contribute nothing to any rule's sums, so the rules of the convolution here must give
    the transposed convolution's relevance.
    """

    def __init__(self, transposed: nn.Module) -> None:
        super().__init__()
        self.t = transposed
        dims = transposed.weight.dim() - 2
        groups, (inputs, per_group) = transposed.groups, transposed.weight.shape[:2]
        kernel = transposed.weight.shape[2:]
        # (in, out/g, k) → (out, in/g, k) per group, the kernel flipped
        weight = transposed.weight.reshape(groups, inputs // groups, per_group, *kernel)
        weight = weight.transpose(1, 2).reshape(groups * per_group, inputs // groups, *kernel)
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.conv = conv(
            inputs, groups * per_group, tuple(kernel), groups=groups, dilation=transposed.dilation
        ).double()
        with torch.no_grad():
            self.conv.weight.copy_(weight.flip(tuple(range(2, 2 + dims))))
            self.conv.bias.copy_(transposed.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, dims = self.t, x.dim() - 2
        sizes = [(n - 1) * s + 1 for n, s in zip(x.shape[2:], t.stride, strict=True)]
        spread = x.new_zeros(*x.shape[:2], *sizes)
        spread[(slice(None), slice(None), *(slice(None, None, s) for s in t.stride))] = x
        pad = []
        for d in reversed(range(dims)):  # F.pad: last dimension first
            edge = t.dilation[d] * (t.kernel_size[d] - 1) - t.padding[d]
            pad += [edge, edge + t.output_padding[d]]
        return self.conv(F.pad(spread, pad))


class TransposedBody(nn.Module):
    def __init__(self, up: nn.Module, dims: int, batchnorm: bool) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        norm = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
        self.conv1 = conv(2, 4, 3, padding=1)
        self.up = up
        self.norm = norm(6) if batchnorm else nn.Identity()
        self.conv2 = conv(6, 3, 3, padding=1)
        self.head = nn.Linear(3, 3)
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.up(F.relu(self.conv1(x)))))
        h = F.relu(self.conv2(h)).flatten(2).mean(2)
        return self.head(h)


@pytest.mark.parametrize(
    ("dims", "options", "batchnorm"),
    [
        (2, {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}, True),  # U-Net's up
        (1, {"stride": 3, "padding": 0}, False),
        (3, {"stride": 2, "padding": 1, "dilation": 2}, False),
    ],
    ids=["2d-grouped-batchnorm", "1d", "3d-dilated"],
)
@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.zplus", "lrp.gamma", "lrp.alpha2beta1"])
def test_transposed_convolutions_are_convolutions_of_spread_inputs(
    dims, options, batchnorm, method
):
    torch.manual_seed(5)
    convt = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dims]
    up = convt(4, 6, 3, **options).double()
    model = TransposedBody(up, dims, batchnorm).double()
    if batchnorm:
        with torch.no_grad():
            model.norm.running_mean.uniform_(-0.5, 0.5)
            model.norm.running_var.uniform_(0.5, 2.0)
            model.norm.weight.uniform_(0.5, 1.5)
    model.eval()
    reference = TransposedBody(ZeroInsertedConv(up), dims, batchnorm).double().eval()
    for name in ("conv1", "norm", "conv2", "head"):
        getattr(reference, name).load_state_dict(getattr(model, name).state_dict())
    x = torch.randn(2, 2, *(5,) * dims, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(reference(x), model(x))  # the reference computes the same
    got = explain(model, x, method, 1).attribution
    expected = explain(reference, x, method, 1).attribution
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


# --- structure: layer scale, stochastic depth, dropout, shuffles, permutes, adaptive max pool ---


class ConvNeXtLikeBlock(nn.Module):
    """Depthwise conv, permutes, a channels-last Linear, layer scale, stochastic depth, shuffle."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.pointwise = nn.Linear(channels, channels, bias=False)
        self.layer_scale = nn.Parameter(torch.rand(channels, 1, 1) + 0.5)
        self.drop = StochasticDepth(0.3)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.depthwise(x).permute(0, 2, 3, 1)
        h = F.relu(self.pointwise(self.dropout(h))).permute(0, 3, 1, 2)
        h = x + self.drop(self.layer_scale * h)
        b, c, height, width = h.shape  # ShuffleNet's channel shuffle
        return h.view(b, 2, c // 2, height, width).transpose(1, 2).reshape(b, c, height, width)


def test_structural_layers_conserve_on_a_bias_free_net():
    torch.manual_seed(6)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False),
        nn.ReLU(),
        ConvNeXtLikeBlock(4),
        nn.AdaptiveMaxPool2d(3),
        nn.Flatten(),
        nn.Linear(36, 3, bias=False),
    ).double()
    model.eval()
    result = explain(model, images(), "lrp.z", 1)
    assert result.attribution.abs().sum() > 0
    torch.testing.assert_close(
        result.delta, torch.zeros(3, dtype=torch.float64), atol=1e-10, rtol=0
    )
    # and LRP-0 is Input×Gradient on such a piecewise-linear net
    torch.testing.assert_close(
        result.attribution, explain(model, images(), "input_x_gradient", 1).attribution
    )


class Rearranged(nn.Module):
    """A conv net whose channels and pixels are rearranged by modules or by hand (the reference)."""

    def __init__(self, by_hand: bool) -> None:
        super().__init__()
        self.by_hand = by_hand
        self.stem = nn.Conv2d(2, 8, 3, padding=1, bias=False)
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.head = nn.Linear(16, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))  # (b, 8, 6, 6)
        b = h.shape[0]
        if self.by_hand:  # ShuffleNet's channel shuffle and sub-pixel up-sampling, written out
            h = h.view(b, 2, 4, 6, 6).transpose(1, 2).reshape(b, 8, 6, 6)
            h = h.view(b, 2, 2, 2, 6, 6).permute(0, 1, 4, 2, 5, 3).reshape(b, 2, 12, 12)
            h = h.view(b, 2, 6, 2, 6, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 8, 6, 6)
            h = h.repeat(1, 2, 1, 1)[:, 4:12]
        else:
            h = nn.PixelUnshuffle(2)(nn.PixelShuffle(2)(nn.ChannelShuffle(2)(h)))
            h = h.tile(1, 2, 1, 1)[:, 4:12]
        h = F.relu(self.conv(h))
        return self.head(F.adaptive_avg_pool2d(h, 2).flatten(1)[:, :16])


@pytest.mark.parametrize(
    "method", [*PRESETS, "deeplift.rescale", "guided_bp", "excitation_bp", "rectgrad"]
)
def test_channel_and_pixel_shuffles_are_the_rearrangements_they_are(method):
    # nn.ChannelShuffle, nn.PixelShuffle/PixelUnshuffle and x.repeat/tile were refused by every
    # rule-based method, although each only moves or copies values, as a view and permute does
    torch.manual_seed(0)
    modules, by_hand = Rearranged(False).double().eval(), Rearranged(True).double().eval()
    by_hand.load_state_dict(modules.state_dict())
    x = images()
    torch.testing.assert_close(modules(x), by_hand(x), rtol=0, atol=0)
    got = explain(modules, x, method, 1).attribution
    torch.testing.assert_close(got, explain(by_hand, x, method, 1).attribution)
    if method == "lrp.z":  # and LRP-0 conserves on this bias-free net
        assert explain(modules, x, method, 1).delta.abs().max() < 1e-10


class BiasAdded(nn.Module):
    """A CNN whose convolution and head take their biases as separate additions, or not."""

    def __init__(self, added: str) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.added = added
        self.conv, self.head = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 3)
        self.bare = nn.Conv2d(2, 4, 3, padding=1, bias=False)  # conv without its bias
        with torch.no_grad():  # biases large enough to matter
            self.conv.bias.mul_(3)
            self.head.bias.mul_(3)
            self.bare.weight.copy_(self.conv.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, head = self.conv, self.head
        if self.added == "in the layers":
            return head(torch.relu(conv(x)).mean((2, 3)))
        pooled = torch.relu(self.bare(x) + conv.bias.view(1, -1, 1, 1)).mean((2, 3))
        if self.added == "x @ W.T + b":
            return pooled @ head.weight.T + head.bias
        return head.bias + torch.mm(pooled, head.weight.t())  # b on the left


@pytest.mark.parametrize("added", ["x @ W.T + b", "b + torch.mm(x, W.t())"])
@pytest.mark.parametrize("method", ["lrp.zplus", "lrp.alpha2beta1", "lrp.w2", "excitation_bp"])
def test_a_bias_written_as_an_addition_is_the_layers_bias(method, added):
    # z⁺, αβ, w², flat and Excitation BP ignore biases, but a bias added after the layer took its
    # share of the relevance, unstabilised: Excitation BP's probabilities summed to −0.05 or 7388
    x = torch.rand(3, 2, 6, 6, dtype=torch.float64)
    expected = explain(BiasAdded("in the layers").double().eval(), x, method, 0).attribution
    assert expected.abs().sum() > 0
    got = explain(BiasAdded(added).double().eval(), x, method, 0).attribution
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-10)


class PositionEmbedded(nn.Module):
    """Patches embedded by a bias-free convolution, a position embedding added (ViT's way)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(10)
        self.patches = nn.Conv2d(2, 4, 2, stride=2, bias=False)
        self.position = nn.Parameter(torch.randn(1, 9, 4))
        self.head = nn.Linear(4 * 9, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2) + self.position
        return self.head(torch.relu(tokens).flatten(1))


@pytest.mark.parametrize("method", ["lrp.zplus", "excitation_bp"])
def test_a_position_embedding_added_after_the_patches_is_their_bias(method):
    # arranged (flatten, transpose) before the addition, the layer's output was not known
    # any more: excitation's probabilities summed to 0.1–0.3, z⁺ to a tenth of the logit
    x = torch.rand(3, 2, 6, 6, dtype=torch.float64)
    model = PositionEmbedded().double().eval()
    result = explain(model, x, method, 0)
    expected = (
        torch.ones(3, dtype=torch.float64) if method == "excitation_bp" else result.output[:, 0]
    )
    chosen = result.attribution.sum((1, 2, 3))
    alive = result.output[:, 0] > 0  # z⁺ maps of negative logits may be empty
    torch.testing.assert_close(chosen[alive], expected[alive])


class ReLUAfterLayer(nn.Module):
    """A bias-free layer, a ReLU (in place or not), and a constant added after the ReLU."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.layer, self.head = nn.Linear(5, 6, bias=False), nn.Linear(6, 3)
        self.shift = nn.Parameter(torch.rand(6))
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.layer(x), inplace=self.in_place) + self.shift)


@pytest.mark.parametrize("method", ["lrp.zplus", "excitation_bp", "lrp.alpha2beta1"])
def test_a_constant_added_after_an_in_place_relu_is_no_bias(method):
    # the in-place ReLU kept the layer output's identity, and the constant counted as its bias
    x = torch.randn(4, 5, dtype=torch.float64)
    expected = explain(ReLUAfterLayer(False).double().eval(), x, method, 1).attribution
    got = explain(ReLUAfterLayer(True).double().eval(), x, method, 1).attribution
    torch.testing.assert_close(got, expected)
