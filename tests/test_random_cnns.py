"""Random compositions of today's CNN layers: every method a correct map or one clear error.

The zoo (``tests/test_zoo.py``) checks fixed architectures; here the same layers come in random
orders, widths and activations, so that no rule is only right next to the neighbours the zoo
gives it. Every map is checked as the zoo checks it (``zoo.method_outcome``: conservation on the
bias-free twin, DeepLIFT's summation to delta, autograd, or an independent float64 reference),
and the model (parameters, buffers, hooks, modes) must be unchanged after every call. GroupNorm and
InstanceNorm, which the float64 references do not cover, get the exact checks that need no
reference: LRP-0 conserves on the bias-free twin, the gradient methods equal autograd, and
every other method gives a finite map or one clear error.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, state_fingerprint
from torch import nn
from zoo import (
    AUTOGRAD,
    CONSERVING,
    NORMS,
    LayerNorm2d,
    Permute,
    SqueezeExcitation,
    StochasticDepth,
    method_options,
    method_outcome,
)

from explain_core import explain
from explain_core.errors import ExplainError
from explain_core.plugin_manager import get_registry

WIDTH = 4
ACTIVATIONS = [
    nn.ReLU,
    nn.ReLU6,
    nn.SiLU,
    nn.GELU,
    nn.Hardswish,
    nn.ELU,
    nn.Mish,
    lambda: nn.LeakyReLU(0.1),
]


class Residual(nn.Module):
    """``x + scale · body(x)``: a skip connection, with layer scale and stochastic depth."""

    def __init__(self, body: nn.Module, layer_scale: bool) -> None:
        super().__init__()
        self.body = body
        self.scale = nn.Parameter(torch.full((WIDTH, 1, 1), 0.5)) if layer_scale else None
        self.drop = StochasticDepth(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + self.drop(y if self.scale is None else self.scale * y)


class ChannelShuffle(nn.Module):
    """ShuffleNet's shuffle of two channel groups (view, transpose, reshape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        return x.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)


class Interpolated(nn.Module):
    """``F.interpolate`` to twice the size, then a strided convolution back."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.conv = nn.Conv2d(WIDTH, WIDTH, 3, padding=1, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        corners = {} if self.mode == "nearest" else {"align_corners": False}
        return self.conv(F.interpolate(x, scale_factor=2, mode=self.mode, **corners))


def _activation(rng: random.Random) -> nn.Module:
    return rng.choice(ACTIVATIONS)()


def _norm(rng: random.Random, per_sample: bool) -> nn.Module:
    """BatchNorm or a channels-first LayerNorm; with ``per_sample`` also GroupNorm, InstanceNorm."""
    choices = [lambda: nn.BatchNorm2d(WIDTH), lambda: LayerNorm2d(WIDTH)]
    if per_sample:
        choices += [
            lambda: nn.GroupNorm(2, WIDTH),
            lambda: nn.InstanceNorm2d(WIDTH, affine=True),
        ]
    return rng.choice(choices)()


BLOCK_KINDS = 8
SEEDS = range(6)


def _block(rng: random.Random, kind: int, per_sample: bool) -> nn.Module:
    c = WIDTH
    if kind == 0:  # a residual block with a norm and an activation
        conv = nn.Conv2d(c, c, 3, padding=1)
        body = nn.Sequential(conv, _norm(rng, per_sample), _activation(rng))
        return Residual(body, layer_scale=rng.random() < 0.5)
    if kind == 1:  # depthwise separable
        return nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, groups=c),
            _norm(rng, per_sample),
            _activation(rng),
            nn.Conv2d(c, c, 1),
        )
    if kind == 2:
        gate = rng.choice([nn.Sigmoid, nn.Hardsigmoid])
        return SqueezeExcitation(c, c // 2, activation=rng.choice([nn.ReLU, nn.SiLU]), gate=gate)
    if kind == 3:
        return ChannelShuffle()
    if kind == 4:  # ConvNeXt's channels-last LayerNorm and Linear layers
        return Residual(
            nn.Sequential(
                nn.Conv2d(c, c, 7, padding=3, groups=c),
                Permute([0, 2, 3, 1]),
                nn.LayerNorm(c),
                nn.Linear(c, 2 * c),
                nn.GELU(),
                nn.Linear(2 * c, c),
                Permute([0, 3, 1, 2]),
            ),
            layer_scale=True,
        )
    if kind == 5:
        return nn.Sequential(nn.ConvTranspose2d(c, c, 2, stride=2), nn.AdaptiveMaxPool2d(8))
    if kind == 6:
        return Interpolated(rng.choice(["nearest", "bilinear"]))
    return nn.Sequential(nn.Dropout(0.2), nn.Conv2d(c, c, 3, padding=1), _activation(rng))


def random_cnn(seed: int, per_sample: bool = False) -> nn.Module:
    """A stem, three random blocks and a classifier head of 5 classes, for 3×8×8 inputs."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layers = [nn.Conv2d(3, WIDTH, 3, padding=1), _norm(rng, per_sample), _activation(rng)]
    layers += [_block(rng, kind, per_sample) for kind in _kinds(seed)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(WIDTH, 5)]
    model = nn.Sequential(*layers)
    with torch.no_grad():  # norms' affine parameters other than their initial ones and zero
        for module in model.modules():
            if isinstance(module, NORMS):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
    return model


def _kinds(seed: int) -> list[int]:
    """The kinds of ``random_cnn(seed)``'s three blocks: the next three in turn, shuffled."""
    kinds = [(3 * seed + i) % BLOCK_KINDS for i in range(3)]
    random.Random(seed).shuffle(kinds)
    return kinds


def _inputs(seed: int) -> torch.Tensor:
    return torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_the_seeds_build_every_kind_of_block():
    assert {kind for seed in SEEDS for kind in _kinds(seed)} == set(range(BLOCK_KINDS))


def _explain_watched(method: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``method``'s map on ``model`` (``None`` for a clear refusal); the model must not change."""
    model.eval()
    before = state_fingerprint(model)
    try:
        options = method_options(method, model, x)  # PatternNet's fit may refuse the model
        return explain(model, x, method, 1, **options).attribution
    except ExplainError as error:
        assert "\n" not in str(error).strip(), (method, str(error))  # one clear line
        return None
    finally:
        assert_same_state(before, state_fingerprint(model))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_compositions_are_explained_correctly_or_refused_clearly(seed):
    x = _inputs(seed)
    for method in sorted(get_registry()):
        outcome = method_outcome(method, lambda: random_cnn(seed), x)
        assert outcome.startswith(("✓", "refuses", "needs")), (method, outcome)
        _explain_watched(method, random_cnn(seed), x)


@pytest.mark.parametrize("seed", SEEDS)
def test_group_and_instance_norms_in_random_places_conserve_or_refuse_clearly(seed):
    x = _inputs(seed)
    make = partial(random_cnn, seed, per_sample=True)
    for method in sorted(get_registry()):
        if method in (*CONSERVING, *AUTOGRAD):  # exact checks that need no reference
            outcome = method_outcome(method, make, x)
            if method == "dynamic.contributions":  # a norm's scale is not dynamic-linear
                assert outcome.startswith(
                    ("✓", "refuses `group_norm`", "refuses `instance_norm`", "refuses `layer_norm`")
                ), outcome
            else:
                assert outcome.startswith("✓"), (method, outcome)
        attribution = _explain_watched(method, make(), x)
        assert attribution is None or torch.isfinite(attribution).all(), method
