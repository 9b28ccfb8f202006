"""Re-creations of the torchvision classification zoo (and a U-Net) for the relevance tests.

Each follows its torchvision model's module structure as written — in-place ReLUs reused within a
block, ``torch.flatten``, ``F.adaptive_avg_pool2d``, squeeze-excitation that multiplies by a
sigmoid or hard-sigmoid gate, ConvNeXt's ``Permute`` modules and channels-last LayerNorm,
stochastic depth and layer scale — with a width multiplier and stage depths small enough for the
test suite (the real models, at 224×224, are checked by ``benchmarks/check_torchvision_zoo.py``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
import zoo_references
from torch import nn

from explain_core import explain
from explain_core.errors import ExplainError


def _w(channels: int, width: float) -> int:
    return max(4, round(channels * width / 4) * 4)


# --- ResNet-50: bottlenecks with one ReLU module reused three times -----------------------------


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, depths=(3, 4, 6, 3), width: float = 1.0, classes: int = 10) -> None:
        super().__init__()
        self.inplanes = _w(64, width)
        self.conv1 = nn.Conv2d(3, self.inplanes, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages = []
        for index, depth in enumerate(depths):
            stages.append(self._stage(_w(64 * 2**index, width), depth, 1 if index == 0 else 2))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.inplanes, classes)

    def _stage(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * 4, 1, stride, bias=False),
                nn.BatchNorm2d(planes * 4),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# --- VGG-16 with BatchNorm ------------------------------------------------------------------


class VGG(nn.Module):
    CONFIG = (
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        "M",
    )

    def __init__(self, width: float = 1.0, classes: int = 10, hidden: int = 4096) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in self.CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                out = _w(int(item), width)
                layers += [
                    nn.Conv2d(channels, out, 3, padding=1),
                    nn.BatchNorm2d(out),
                    nn.ReLU(True),
                ]
                channels = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(channels * 49, hidden), nn.ReLU(True), nn.Dropout(0.5),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(0.5), nn.Linear(hidden, classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# --- DenseNet-121: pre-activation BatchNorms and concatenations ------------------------------


class DenseLayer(nn.Module):
    def __init__(self, channels: int, growth: int, bottleneck: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(channels, bottleneck * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bottleneck * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bottleneck * growth, growth, 3, padding=1, bias=False)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        concatenated = torch.cat(inputs, 1)
        bottleneck = self.conv1(self.relu1(self.norm1(concatenated)))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers: int, channels: int, growth: int) -> None:
        super().__init__()
        for index in range(layers):
            self.add_module(f"denselayer{index + 1}", DenseLayer(channels + index * growth, growth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    def __init__(self, depths=(6, 12, 24, 16), width: float = 1.0, classes: int = 10) -> None:
        super().__init__()
        growth, channels = _w(32, width), _w(64, width)
        stem = [
            ("conv0", nn.Conv2d(3, channels, 7, 2, 3, bias=False)),
            ("norm0", nn.BatchNorm2d(channels)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(3, 2, 1)),
        ]
        self.features = nn.Sequential()
        for name, module in stem:
            self.features.add_module(name, module)
        for index, layers in enumerate(depths):
            self.features.add_module(f"denseblock{index + 1}", DenseBlock(layers, channels, growth))
            channels += layers * growth
            if index != len(depths) - 1:
                transition = nn.Sequential(
                    nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
                    nn.Conv2d(channels, channels // 2, 1, bias=False), nn.AvgPool2d(2, 2),
                )  # fmt: skip
                self.features.add_module(f"transition{index + 1}", transition)
                channels //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(channels))
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.features(x), inplace=True)
        out = torch.flatten(F.adaptive_avg_pool2d(out, (1, 1)), 1)
        return self.classifier(out)


# --- squeeze-excitation and inverted residuals (MobileNetV3, EfficientNet, RegNetY) -----------


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeezed: int, activation=nn.ReLU, gate=nn.Sigmoid) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = activation()
        self.scale_activation = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class StochasticDepth(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.shape[0], *(1,) * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


def conv_bn_act(c_in, c_out, kernel, stride=1, groups=1, activation=nn.ReLU) -> nn.Sequential:
    layers = [
        nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
    ]
    if activation is not None:
        layers.append(activation(inplace=True) if activation is not nn.GELU else activation())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV3's block (``se`` with a hard-sigmoid gate) and EfficientNet's MBConv."""

    def __init__(self, c_in, expanded, c_out, kernel, stride, se, activation, gate, drop=0.0):
        super().__init__()
        self.use_res_connect = stride == 1 and c_in == c_out
        layers: list[nn.Module] = []
        if expanded != c_in:
            layers.append(conv_bn_act(c_in, expanded, 1, activation=activation))
        layers.append(conv_bn_act(expanded, expanded, kernel, stride, expanded, activation))
        if se:
            squeezed = max(4, (c_in if gate is nn.Sigmoid else expanded) // 4)
            inner = nn.SiLU if gate is nn.Sigmoid else nn.ReLU
            layers.append(SqueezeExcitation(expanded, squeezed, inner, gate))
        layers.append(conv_bn_act(expanded, c_out, 1, activation=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result) + x
        return result


class MobileNetV3(nn.Module):
    # (kernel, expanded, out, se, hardswish, stride): mobilenet_v3_large's settings
    SETTINGS = (
        (3, 16, 16, False, False, 1), (3, 64, 24, False, False, 2), (3, 72, 24, False, False, 1),
        (5, 72, 40, True, False, 2), (5, 120, 40, True, False, 1), (5, 120, 40, True, False, 1),
        (3, 240, 80, False, True, 2), (3, 200, 80, False, True, 1), (3, 184, 80, False, True, 1),
        (3, 184, 80, False, True, 1), (3, 480, 112, True, True, 1), (3, 672, 112, True, True, 1),
        (5, 672, 160, True, True, 2), (5, 960, 160, True, True, 1), (5, 960, 160, True, True, 1),
    )  # fmt: skip

    def __init__(self, width: float = 1.0, classes: int = 10, blocks: int = 15) -> None:
        super().__init__()
        c = _w(16, width)
        layers: list[nn.Module] = [conv_bn_act(3, c, 3, 2, activation=nn.Hardswish)]
        for kernel, expanded, out, se, hardswish, stride in self.SETTINGS[:blocks]:
            act = nn.Hardswish if hardswish else nn.ReLU
            expanded, out = _w(expanded, width), _w(out, width)
            layers.append(
                InvertedResidual(c, expanded, out, kernel, stride, se, act, nn.Hardsigmoid)
            )
            c = out
        layers.append(conv_bn_act(c, 6 * c, 1, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(6 * c, _w(1280, width)), nn.Hardswish(inplace=True), nn.Dropout(0.2, True),
            nn.Linear(_w(1280, width), classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class EfficientNet(nn.Module):
    # (expand ratio, kernel, stride, out, repeats): efficientnet_b0's stages
    STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
              (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))  # fmt: skip

    def __init__(self, width: float = 1.0, classes: int = 10, max_repeats: int = 4) -> None:
        super().__init__()
        c = _w(32, width)
        layers: list[nn.Module] = [conv_bn_act(3, c, 3, 2, activation=nn.SiLU)]
        total = sum(min(r, max_repeats) for *_, r in self.STAGES)
        index = 0
        for ratio, kernel, stride, out, repeats in self.STAGES:
            stage = []
            for repeat in range(min(repeats, max_repeats)):
                drop = 0.2 * index / total
                block_in = c if repeat == 0 else _w(out, width)
                stage.append(
                    InvertedResidual(block_in, block_in * ratio, _w(out, width), kernel,
                                     stride if repeat == 0 else 1, True, nn.SiLU, nn.Sigmoid, drop)
                )  # fmt: skip
                index += 1
            layers.append(nn.Sequential(*stage))
            c = _w(out, width)
        layers.append(conv_bn_act(c, 4 * c, 1, activation=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(4 * c, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# --- ConvNeXt: Permute modules, channels-last LayerNorm, layer scale ----------------------------


class Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float, drop: float) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, 7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim, bias=True),
            nn.GELU(),
            nn.Linear(4 * dim, dim, bias=True),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.layer_scale * self.block(x)
        return self.stochastic_depth(result) + x


class ConvNeXt(nn.Module):
    def __init__(self, depths=(3, 3, 9, 3), width: float = 1.0, classes: int = 10) -> None:
        super().__init__()
        dims = [_w(d, width) for d in (96, 192, 384, 768)]
        layers: list[nn.Module] = [
            nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))
        ]
        for index, depth in enumerate(depths):
            layers.append(
                nn.Sequential(*(CNBlock(dims[index], 1e-6 * 1e5, 0.1) for _ in range(depth)))
            )
            if index < len(depths) - 1:
                layers.append(
                    nn.Sequential(LayerNorm2d(dims[index], eps=1e-6),
                                  nn.Conv2d(dims[index], dims[index + 1], 2, 2))
                )  # fmt: skip
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            LayerNorm2d(dims[-1], eps=1e-6), nn.Flatten(1), nn.Linear(dims[-1], classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)))


# --- RegNetY-400MF: grouped bottlenecks with squeeze-excitation -------------------------------


class ResBottleneckBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, group_width: int, se_ratio: float):
        super().__init__()
        groups = c_out // group_width
        self.proj = None
        if c_in != c_out or stride != 1:
            self.proj = conv_bn_act(c_in, c_out, 1, stride, activation=None)
        self.f = nn.Sequential(
            conv_bn_act(c_in, c_out, 1),
            conv_bn_act(c_out, c_out, 3, stride, groups),
            SqueezeExcitation(c_out, max(1, round(se_ratio * c_in))),
            conv_bn_act(c_out, c_out, 1, activation=None),
        )
        self.activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.proj is None else self.proj(x)
        return self.activation(shortcut + self.f(x))


class RegNet(nn.Module):
    # regnet_y_400mf: widths, depths, group width 8, SE ratio 0.25
    def __init__(self, depths=(1, 3, 6, 6), width: float = 1.0, classes: int = 10) -> None:
        super().__init__()
        widths = [_w(w, width) for w in (48, 104, 208, 440)]
        group = max(4, _w(8, width))
        widths = [max(group, (w // group) * group) for w in widths]
        self.stem = conv_bn_act(3, _w(32, width), 3, 2)
        c = _w(32, width)
        stages = []
        for w, depth in zip(widths, depths, strict=True):
            blocks = [ResBottleneckBlock(c if i == 0 else w, w, 2 if i == 0 else 1, group, 0.25)
                      for i in range(depth)]  # fmt: skip
            stages.append(nn.Sequential(*blocks))
            c = w
        self.trunk_output = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.trunk_output(self.stem(x))
        return self.fc(self.avgpool(x).flatten(start_dim=1))


# --- SqueezeNet 1.1: Fire modules, a convolutional classifier ---------------------------------


class Fire(nn.Module):
    def __init__(self, c_in: int, squeeze: int, expand1: int, expand3: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(c_in, squeeze, 1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand1, 1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand3, 3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat(
            [self.expand1x1_activation(self.expand1x1(x)),
             self.expand3x3_activation(self.expand3x3(x))], 1,
        )  # fmt: skip


class SqueezeNet(nn.Module):
    def __init__(self, width: float = 1.0, classes: int = 10) -> None:
        super().__init__()

        def fire(c_in, s, e):
            return Fire(_w(c_in, width), _w(s, width), _w(e, width), _w(e, width))

        self.features = nn.Sequential(
            nn.Conv2d(3, _w(64, width), 3, 2), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, ceil_mode=True), fire(64, 16, 64), fire(128, 16, 64),
            nn.MaxPool2d(3, 2, ceil_mode=True), fire(128, 32, 128), fire(256, 32, 128),
            nn.MaxPool2d(3, 2, ceil_mode=True), fire(256, 48, 192), fire(384, 48, 192),
            fire(384, 64, 256), fire(512, 64, 256),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Conv2d(_w(512, width), classes, 1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d((1, 1)),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


# --- U-Net for segmentation, with an explained pixel or region --------------------------------


class UNet(nn.Module):
    """A two-level U-Net: per-pixel class scores ``(batch, classes, H, W)``."""

    def __init__(self, width: float = 1.0, classes: int = 3) -> None:
        super().__init__()
        c1, c2, c3 = _w(32, width), _w(64, width), _w(128, width)

        def double(c_in, c_out):
            return nn.Sequential(conv_bn_act(c_in, c_out, 3), conv_bn_act(c_out, c_out, 3))

        self.down1, self.down2, self.bottom = double(3, c1), double(c1, c2), double(c2, c3)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(c3, c2, 2, 2)
        self.dec2 = double(2 * c2, c2)
        self.up1 = nn.ConvTranspose2d(c2, c1, 2, 2)
        self.dec1 = double(2 * c1, c1)
        self.head = nn.Conv2d(c1, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        bottom = self.bottom(self.pool(d2))
        u2 = self.dec2(torch.cat([self.up2(bottom), d2], 1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], 1))
        return self.head(u1)


class ExplainedRegion(nn.Module):
    """A segmentation model's score for one pixel (or a region's summed score), per class."""

    def __init__(self, model: nn.Module, rows: slice, cols: slice) -> None:
        super().__init__()
        self.model, self.rows, self.cols = model, rows, cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[:, :, self.rows, self.cols].sum((2, 3))


# --- what each method does on a model ---

# Exact properties: conservation on the bias-free twin, or DeepLIFT's summation to delta.
CONSERVING = ("lrp.z", "lrp.cp", "lrp.attn")
SUMMING = ("deeplift.rescale", "deeplift.reveal_cancel")
# Equal to torch's own gradient of the explained logit (times the input); dynamic.contributions
# is Input×Gradient on models without dynamic-linear layers.
AUTOGRAD = ("gradient", "input_x_gradient", "dynamic.contributions")
RECTIFIED = {"guided_bp": "guided", "deconv": "deconv", "rectgrad": "rectgrad"}


def method_options(method: str, model: torch.nn.Module, x: torch.Tensor) -> dict:
    """The options ``method`` needs on the zoo (patterns fitted from 8 random inputs like ``x``)."""
    if method in ("lrp.zb", "lrp.epsilon_gamma_box"):
        return {"low": 0.0, "high": 1.0}
    if method == "lrp.custom":
        from explain_modbp.composites import lrp_epsilon_plus

        return {"composite": lrp_epsilon_plus()}
    if method in ("patternnet", "pattern_attribution"):
        from explain_modbp.pattern import fit_patterns

        data = torch.rand(8, *x.shape[1:], generator=torch.Generator().manual_seed(2))
        return {"patterns": fit_patterns(model, data.to(x))}
    return {}


_WHERE = re.compile(r"(?:operation '(\w+)' in module '[^']*' \((\w+)\))|module '[^']*' \((\w+)\)")


def _refusal(error: ExplainError) -> str:
    """The error in a table cell: what was refused (the operation and the module's type)."""
    message = str(error)
    assert "\n" not in message.strip(), message  # one clear line
    match = _WHERE.search(message)
    if match and match.group(1):
        return f"refuses `{match.group(1)}` ({match.group(2)})"
    if match:
        return f"refuses {match.group(3)}"
    if "NaN or infinite attributions" in message:
        return "overflows in float32 (clear error)"
    if "CoDA" in message or "DAU" in message:
        return "needs a CoDA-Net"
    if "capsule" in message.lower():
        return "needs a capsule net"
    return "refuses: " + message[:40]


def method_outcome(method: str, make: Callable[[], nn.Module], x: torch.Tensor) -> str:
    """What ``method`` does on the model ``make()`` builds, as a cell of the zoo's table.

    Raises:
        AssertionError: For a map that is not finite or breaks its method's exact property.
    """
    torch.manual_seed(0)
    model = randomise_batchnorm(make()).eval()
    name = type(model).__name__
    try:
        options = method_options(method, model, x)
        result = explain(model, x, method, 1, **options)
    except ExplainError as error:
        return _refusal(error)
    assert torch.isfinite(result.attribution).all(), (method, name)
    if method in SUMMING:  # on the model itself: Σ maps = f(x) − f(0), biases and all
        gain = result.output[:, 1] - model(torch.zeros_like(x))[:, 1].detach()
        total = result.attribution.sum((1, 2, 3))
        assert torch.allclose(total, gain, rtol=1e-3, atol=1e-5), (method, name)
        reference = float64_reference(method, model, x, options)
        assert reference is not None, method
        _assert_equals(reference, method, model, x, options)  # and its float64 reference
        return "✓ sums to f(x) − f(0)"
    if method in AUTOGRAD:  # the reference: torch's own gradient of the explained logit
        inputs = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(model(inputs)[:, 1].sum(), inputs)
        expected = grad if method == "gradient" else x * grad
        assert torch.allclose(result.attribution, expected, rtol=1e-5, atol=1e-7), (method, name)
        return "✓ equals autograd"
    if method == "lrp.attn":  # on attention (a softmax of the input) it does not conserve
        reference, attention = zoo_references.reference_attn_lrp(model, x, 1)
        if attention:
            zero = not _assert_equals(reference, method, model, x, options)
            return "✓ equals float64 reference" + " (all zero)" * zero
    if method in CONSERVING:
        torch.manual_seed(0)
        twin = bias_free(randomise_batchnorm(make())).double().eval()
        checked = explain(twin, x.double(), method, 1)
        scale = checked.output[:, 1].abs().max()
        assert checked.delta.abs().max() <= 1e-9 * scale + 1e-15, (method, name, checked.delta)
        return "✓ conserves"
    reference = float64_reference(method, model, x, options)
    if reference is not None:
        zero = not _assert_equals(reference, method, model, x, options)
        return "✓ equals float64 reference" + " (all zero)" * zero
    return "runs" if result.attribution.abs().sum() > 0 else "runs (all zero)"


def _assert_equals(
    reference: torch.Tensor, method: str, model: nn.Module, x: torch.Tensor, options: dict
) -> bool:
    """Assert ``method`` on a float64 copy equals ``reference``; return whether it is non-zero."""
    ours = explain(copy.deepcopy(model).double(), x.double(), method, 1, **options)
    scale = reference.abs().max()
    name = type(model).__name__
    assert (ours.attribution - reference).abs().max() <= 1e-9 * scale, (method, name)
    return bool(scale > 0)


def float64_reference(
    method: str, model: nn.Module, x: torch.Tensor, options: dict
) -> torch.Tensor | None:
    """An independent float64 reference for ``method``'s map on ``model`` (class 1), if any."""
    if method in zoo_references.PRESETS:
        return zoo_references.reference_relevance(model, x, method, 1)
    if method == "lrp.contrastive":
        return zoo_references.reference_contrastive_lrp(model, x, 1)
    if method in RECTIFIED:
        return zoo_references.reference_rectified(model, x, RECTIFIED[method], 1)
    if method in ("patternnet", "pattern_attribution"):  # the backward, given the patterns
        patterns = options["patterns"].patterns
        attribution = method == "pattern_attribution"
        return zoo_references.reference_pattern(model, x, patterns, attribution, 1)
    if method == "smoothgrad":
        return zoo_references.reference_smoothgrad(model, x, 1)
    if method == "integrated_gradients":
        return zoo_references.reference_integrated_gradients(model, x, 1)
    if method.startswith("deeplift."):
        return zoo_references.reference_deeplift(model, x, method.removeprefix("deeplift."), 1)
    return None


# --- the zoo --------------------------------------------------------------------------------

ZOO: dict[str, Callable[[], nn.Module]] = {
    "resnet50": lambda: ResNet(depths=(1, 1, 1, 1), width=0.125),
    "vgg16_bn": lambda: VGG(width=0.0625, hidden=32),
    "densenet121": lambda: DenseNet(depths=(2, 2, 2, 2), width=0.25),
    "mobilenet_v3_large": lambda: MobileNetV3(width=0.25, blocks=15),
    "efficientnet_b0": lambda: EfficientNet(width=0.25, max_repeats=1),
    "convnext_tiny": lambda: ConvNeXt(depths=(1, 1, 1, 1), width=0.0625),
    "regnet_y_400mf": lambda: RegNet(depths=(1, 1, 1, 1), width=0.25),
    "squeezenet1_1": lambda: SqueezeNet(width=0.25),
    "unet (pixel)": lambda: ExplainedRegion(UNet(width=0.25), slice(12, 13), slice(20, 21)),
    "unet (region)": lambda: ExplainedRegion(UNet(width=0.25), slice(8, 16), slice(8, 24)),
}
"""Name → a small re-creation (eval mode is up to the caller)."""


def randomise_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm non-trivial running statistics and affine parameters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                size = module.num_features
                module.running_mean.copy_(torch.randn(size, generator=generator) * 0.1)
                module.running_var.copy_(torch.rand(size, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(size, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(size, generator=generator) * 0.1)
    return model


NORMS = (nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm2d)
"""Norm layers with an affine offset (``bias``)."""


def bias_free(model: nn.Module) -> nn.Module:
    """The same model without biases on its signal path: every bias, BatchNorm shift and
    LayerNorm/GroupNorm/InstanceNorm offset zero (a squeeze-excitation gate's own biases do not
    matter), and the constants a vision transformer adds to its tokens (class token, position
    embeddings; biases added to attention scores before the softmax do not matter either).
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.bias.zero_()
                module.running_mean.zero_()
            elif (
                isinstance(module, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear, *NORMS))
                and module.bias is not None
            ):
                module.bias.zero_()
            elif isinstance(module, nn.MultiheadAttention) and module.in_proj_bias is not None:
                module.in_proj_bias.zero_()
        for name, parameter in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("class_token", "pos_embedding"):  # torchvision's ViT
                parameter.zero_()
    return model
