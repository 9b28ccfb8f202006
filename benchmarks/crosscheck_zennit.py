"""Cross-check the LRP composites against zennit, an independent LRP implementation.

zennit (https://github.com/chr-peters/zennit) depends on torchvision, which must never be
installed beside this project's CPU torch (it replaces torch with a multi-GB CUDA build). So run
this in a separate environment with zennit installed without its dependencies:

    python -m venv /tmp/zennit-env && . /tmp/zennit-env/bin/activate
    pip install torch==2.13.0 && pip install -e ".[dev]" && pip install --no-deps zennit
    python benchmarks/crosscheck_zennit.py

or, for the torchvision ResNet-18 rows too, in the torchvision environment of
``benchmarks/check_torchvision_zoo.py`` with zennit installed there:

    PYTHONPATH=.:plugins:exporters /tmp/tv-env/bin/python benchmarks/crosscheck_zennit.py

``zennit/__init__`` imports its torchvision canonizers, which import two torchvision classes;
when torchvision is missing this script registers an empty stand-in module for that import only
(nothing of it is used).

Compared, in float64 on a VGG-style CNN with BatchNorm, a small ResNet (identity blocks
written as ``branch(x) + x``) and, where torchvision is installed, the real torchvision ResNet-18
with zennit's own ResNet canonizer (its block canonizers and BatchNorm merge), per seed: the
input relevance of one logit (start: one-hot × logit)
for each preset composite and zennit's equivalent. Our z⁺/αβ run with ``bias=True`` (zennit counts
the biases in their denominators; the paper's Eq. 5, our default, does not); two more rows show
what our default and the non-generalised γ rule give against zennit. Two zennit settings:

- ``zennit``: its rules with its defaults, only two adjustments that are not about the rules:
  its BatchNorm merge keeps the BatchNorm's ``eps`` after setting the running variance to 1 (so
  the merged model's logits differ from the model's by ~5e-6), here replaced by an exact merge;
  and its residual additions get zennit's ``Sum`` module with the ``Norm`` rule (zennit's own
  ResNet canonizer does that; without it autograd gives both summands the full relevance).
- ``exact division``: the same with zennit's ±1e-6 stabiliser of z⁺/αβ/flat/z^B/``Norm``
  denominators replaced by exact division (0 where the denominator is 0), as ours does.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch
from torch import nn


def _allow_zennit_import_without_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    stand_in = types.ModuleType("torchvision")
    models = types.ModuleType("torchvision.models")
    resnet = types.ModuleType("torchvision.models.resnet")
    resnet.BasicBlock = type("BasicBlock", (nn.Module,), {})  # type: ignore[attr-defined]
    resnet.Bottleneck = type("Bottleneck", (nn.Module,), {})  # type: ignore[attr-defined]
    stand_in.models, models.resnet = models, resnet  # type: ignore[attr-defined]
    sys.modules.update(
        {"torchvision": stand_in, "torchvision.models": models, "torchvision.models.resnet": resnet}
    )


_allow_zennit_import_without_torchvision()

import zennit.composites as zcomp  # noqa: E402
import zennit.rules as zrules  # noqa: E402
from harness import write_results  # noqa: E402
from zennit.attribution import Gradient as ZennitGradient  # noqa: E402
from zennit.canonizers import AttributeCanonizer, SequentialMergeBatchNorm  # noqa: E402
from zennit.layer import Sum  # noqa: E402
from zennit.types import Convolution  # noqa: E402

from explain_modbp import composites, rules  # noqa: E402
from explain_modbp.methods import run_composite  # noqa: E402

SEEDS = (0, 1, 2)
TARGETS = torch.tensor([3, 7])
LOW, HIGH = -1.5, 2.0


def _trained_looking(bn: nn.BatchNorm2d) -> nn.BatchNorm2d:
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.3, 0.3)
    return bn


def _conv_bn_relu(channels_in: int, channels_out: int) -> list[nn.Module]:
    conv = nn.Conv2d(channels_in, channels_out, 3, padding=1)
    return [conv, _trained_looking(nn.BatchNorm2d(channels_out)), nn.ReLU()]


def vgg_bn() -> nn.Module:
    return nn.Sequential(
        *_conv_bn_relu(3, 8), *_conv_bn_relu(8, 8), nn.MaxPool2d(2),
        *_conv_bn_relu(8, 16), *_conv_bn_relu(16, 16), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10),
    )  # fmt: skip


class IdentityBlock(nn.Module):
    """conv-BN-ReLU-conv-BN, plus the block's input, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            _trained_looking(nn.BatchNorm2d(channels)),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            _trained_looking(nn.BatchNorm2d(channels)),
        )
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.branch(x) + x)


def resnet() -> nn.Module:
    return nn.Sequential(
        *_conv_bn_relu(3, 8), IdentityBlock(8), IdentityBlock(8),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(8 * 4, 10),
    )  # fmt: skip


class _ExactMergeBatchNorm(SequentialMergeBatchNorm):
    """zennit's merge, with the BatchNorm's ``eps`` also set to 0 while merged."""

    def register(self, linears: Any, batch_norm: nn.Module) -> None:
        self._eps = batch_norm.eps
        super().register(linears, batch_norm)
        batch_norm.eps = 0.0

    def remove(self) -> None:
        super().remove()
        self.batch_norm.eps = self._eps


class _BlockSum(AttributeCanonizer):
    """Route each block's ``branch(x) + x`` through zennit's ``Sum`` module."""

    def __init__(self) -> None:
        super().__init__(self._attributes)

    @staticmethod
    def _attributes(name: str, module: nn.Module) -> dict[str, Any] | None:
        if not isinstance(module, IdentityBlock):
            return None

        def forward(self: IdentityBlock, x: torch.Tensor) -> torch.Tensor:
            return self.relu(self.canonizer_sum(torch.stack([x, self.branch(x)], dim=-1)))

        return {"forward": forward.__get__(module), "canonizer_sum": Sum()}


def _exact(denominator: torch.Tensor) -> torch.Tensor:
    """Exact division with 0 for 0/0 (zennit divides by what its stabiliser returns)."""
    return torch.where(denominator == 0, torch.full_like(denominator, float("inf")), denominator)


ZennitFactory = Callable[[Any, list[Any]], Any]


def _cases() -> dict[str, tuple[Any, ZennitFactory]]:
    """Name → (our composite, zennit composite from (stabiliser, canonizers))."""
    eps = 1e-6

    def everywhere(rule: Callable[[Any], Any]) -> ZennitFactory:
        return lambda st, canon: zcomp.LayerMapComposite(
            [*zcomp.layer_map_base(st), (Convolution, rule(st)), (nn.Linear, rule(st))],
            canonizers=canon,
        )

    return {
        "lrp.epsilon (ε=0.25) ~ Epsilon": (
            composites.lrp_epsilon(0.25),
            everywhere(lambda st: zrules.Epsilon(0.25)),
        ),
        "lrp.zplus bias=True ~ ZPlus": (
            composites.lrp_zplus(bias=True),
            everywhere(lambda st: zrules.ZPlus(st)),
        ),
        "lrp.alpha_beta bias=True ~ AlphaBeta(2, 1)": (
            composites.lrp_alpha_beta(2.0, 1.0, bias=True),
            everywhere(lambda st: zrules.AlphaBeta(2.0, 1.0, st)),
        ),
        "lrp.gamma ~ Gamma(0.25)": (
            composites.lrp_gamma(0.25),
            everywhere(lambda st: zrules.Gamma(0.25)),
        ),
        "lrp.epsilon_plus bias=True ~ EpsilonPlus": (
            composites.lrp_epsilon_plus(eps, bias=True),
            lambda st, canon: zcomp.EpsilonPlus(epsilon=eps, stabilizer=st, canonizers=canon),
        ),
        "lrp.epsilon_plus, default (bias ignored) ~ EpsilonPlus": (
            composites.lrp_epsilon_plus(eps),
            lambda st, canon: zcomp.EpsilonPlus(epsilon=eps, stabilizer=st, canonizers=canon),
        ),
        "lrp.gamma generalised=False ~ Gamma(0.25)": (
            composites.lrp_gamma(0.25, generalised=False),
            everywhere(lambda st: zrules.Gamma(0.25)),
        ),
        "lrp.flat bias=True ~ EpsilonPlusFlat": (
            composites.lrp_flat(eps, bias=True),
            lambda st, canon: zcomp.EpsilonPlusFlat(epsilon=eps, stabilizer=st, canonizers=canon),
        ),
        "αβ(2,1, bias=True) + ε ~ EpsilonAlpha2Beta1": (
            composites.conv_dense(
                rules.AlphaBeta(2.0, 1.0, bias=True), rules.Epsilon(eps), "ea2b1"
            ),
            lambda st, canon: zcomp.EpsilonAlpha2Beta1(
                epsilon=eps, stabilizer=st, canonizers=canon
            ),
        ),
        "lrp.epsilon_gamma_box ~ EpsilonGammaBox": (
            composites.lrp_epsilon_gamma_box(LOW, HIGH, gamma=0.25, epsilon=eps),
            lambda st, canon: zcomp.EpsilonGammaBox(
                low=LOW, high=HIGH, epsilon=eps, gamma=0.25, stabilizer=st, canonizers=canon
            ),
        ),
    }


def _zennit_relevance(model: nn.Module, x: torch.Tensor, composite: Any) -> torch.Tensor:
    with ZennitGradient(model=model, composite=composite) as attributor:
        _, relevance = attributor(
            x, lambda out: nn.functional.one_hot(TARGETS, out.shape[1]).to(out) * out
        )
    return relevance


def torchvision_resnet18() -> nn.Module:
    """The real torchvision ResNet-18 (random weights, trained-looking BatchNorms)."""
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            _trained_looking(module)
    return model


def _networks() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], list[Any]], int]]:
    """Name → (model, zennit's canonizers for it, input side)."""
    networks = {
        "VGG-style + BatchNorm": (vgg_bn, lambda: [_ExactMergeBatchNorm()], 32),
        "ResNet blocks": (resnet, lambda: [_ExactMergeBatchNorm(), _BlockSum()], 32),
    }
    if importlib.util.find_spec("torchvision") is not None:  # zennit's own ResNet canonizer
        from zennit.torchvision import ResNetBasicBlockCanonizer, ResNetBottleneckCanonizer

        networks["torchvision ResNet-18, zennit's ResNetCanonizer"] = (
            torchvision_resnet18,
            lambda: [
                _ExactMergeBatchNorm(),
                ResNetBottleneckCanonizer(),
                ResNetBasicBlockCanonizer(),
            ],
            64,
        )
    return networks


def main() -> None:
    torch.set_default_dtype(torch.float64)
    networks = _networks()
    settings: dict[str, Any] = {"zennit": 1e-6, "exact division": _exact}
    rows = []
    for name, (ours, zennit_composite) in _cases().items():
        for network, (build, canonizers_for, side) in networks.items():
            worst = dict.fromkeys(settings, 0.0)
            for seed in SEEDS:
                torch.manual_seed(seed)
                model = build().eval()
                x = torch.rand(2, 3, side, side) * (HIGH - LOW) + LOW
                expected = run_composite(ours, model, x, TARGETS).attribution
                for setting, stabiliser in settings.items():
                    canonizers = canonizers_for()
                    got = _zennit_relevance(model, x, zennit_composite(stabiliser, canonizers))
                    relative = float((expected - got).abs().max() / got.abs().max())
                    worst[setting] = max(worst[setting], relative)
            rows.append(
                {"composite ~ zennit": name, "network": network}
                | {f"max rel. diff, {s}": f"{v:.1e}" for s, v in worst.items()}
            )
            print(rows[-1], flush=True)
    write_results(
        "zennit_crosscheck",
        title="LRP composites against zennit (float64)",
        command="python benchmarks/crosscheck_zennit.py  # in an environment with zennit",
        notes=(
            f"zennit {version('zennit')}; max |R_ours − R_zennit| / "
            f"max |R_zennit| over seeds {list(SEEDS)}, batch 2, inputs in [{LOW}, {HIGH}] "
            "(both signs, so the input layer takes the signed forms). 'zennit': its rules with "
            "their ±1e-6 stabiliser; 'exact division': the same rules dividing exactly, as "
            "ours do. Both with an exact BatchNorm merge (zennit's keeps the BatchNorm's eps) "
            "and zennit's Sum/Norm on residual additions. Ours: bias=True for z⁺/αβ (zennit's "
            "convention; the default follows the paper's Eq. 5 and ignores biases) and the "
            "generalised γ rule (the default); two rows show what the other conventions give "
            "(our default bias handling; the paper's w + γw⁺ for every sign). For z^B+γ+ε the "
            "exact-division column also divides zennit's γ exactly while ours keeps γ's "
            "ε = 1e-6."
        ),
        rows=rows,
    )


if __name__ == "__main__":
    main()
