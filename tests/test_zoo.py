"""Every registered method on every architecture of the zoo: a correct map or one clear error.

The method × architecture table in ``docs/zoo.md`` is this test's output: it is computed here and
must equal the page (``EXPLAIN_WRITE_ZOO_TABLE=1 pytest tests/test_zoo.py`` rewrites it). Exact
checks where a method has an exact property: LRP-0, CP-LRP and AttnLRP conserve on the bias-free
twin (every bias, BatchNorm shift and norm offset zero), DeepLIFT's maps sum to ``f(x) − f(0)``,
the gradient methods equal autograd's; every LRP preset, Excitation BP, Contrastive LRP, Guided
BP, Deconv, RectGrad, PatternNet, PatternAttribution, SmoothGrad, Integrated Gradients and
DeepLIFT (all three rules) equal an independent float64 reference (``tests/zoo_references.py``).
Every map must be finite (an all-zero one is marked).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import zoo_references
from torch import nn
from zoo import ZOO, method_outcome, randomise_batchnorm

from explain_core import explain
from explain_core.plugin_manager import get_registry

PAGE = Path(__file__).resolve().parents[1] / "docs" / "zoo.md"
BEGIN, END = "<!-- zoo-table -->", "<!-- /zoo-table -->"


def zoo_table() -> str:
    methods = sorted(get_registry())
    names = list(ZOO)
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    rows = ["| method | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    for method in methods:
        cells = (method_outcome(method, ZOO[name], image) for name in names)
        rows.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def test_every_method_on_every_architecture_is_a_correct_map_or_one_clear_error():
    table = zoo_table()
    page = PAGE.read_text(encoding="utf-8")
    before, rest = page.split(BEGIN)
    _, after = rest.split(END)
    expected = f"{before}{BEGIN}\n{table}\n{END}{after}"
    if os.environ.get("EXPLAIN_WRITE_ZOO_TABLE"):
        PAGE.write_text(expected, encoding="utf-8")
        page = expected
    assert page == expected, (
        "docs/zoo.md is out of date: EXPLAIN_WRITE_ZOO_TABLE=1 pytest tests/test_zoo.py"
    )


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v3_large", "convnext_tiny"])
def test_the_re_creations_follow_torchvisions_structure(name):
    model = ZOO[name]()
    kinds = {type(m).__name__ for m in model.modules()}
    expected = {
        "resnet50": {"Bottleneck", "BatchNorm2d", "MaxPool2d", "AdaptiveAvgPool2d"},
        "mobilenet_v3_large": {"InvertedResidual", "SqueezeExcitation", "Hardswish", "Hardsigmoid"},
        "convnext_tiny": {
            "CNBlock",
            "Permute",
            "LayerNorm",
            "LayerNorm2d",
            "GELU",
            "StochasticDepth",
        },
    }[name]
    assert expected <= kinds


def test_the_references_tell_the_rules_apart():
    """A reference that any map would match could not fail: each one rejects its neighbours."""
    torch.manual_seed(0)
    model = randomise_batchnorm(ZOO["resnet50"]()).double().eval()
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)).double()

    def far(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool((a - b).abs().max() > 1e-3 * b.abs().max())

    z_plus = zoo_references.reference_relevance(model, x, "lrp.zplus", 1)
    assert far(explain(model, x, "lrp.epsilon_plus", 1).attribution, z_plus)  # ε on the head
    epsilon = zoo_references.reference_relevance(model, x, "lrp.epsilon", 1)
    assert far(explain(model, x, "lrp.epsilon", 1, epsilon=0.1).attribution, epsilon)
    guided = zoo_references.reference_rectified(model, x, "guided", 1)
    assert far(explain(model, x, "deconv", 1).attribution, guided)
    decoupled = zoo_references.reference_deeplift(model, x, "ablation", 1)
    assert far(explain(model, x, "deeplift.reveal_cancel", 1).attribution, decoupled)
    noisier = zoo_references.reference_smoothgrad(model, x, 1, noise_level=0.3)
    assert far(explain(model, x, "smoothgrad", 1).attribution, noisier)


class _CatAvgMax(nn.Module):
    """timm's ``SelectAdaptivePool2d(pool_type='catavgmax', flatten=True)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = (F.adaptive_avg_pool2d(x, 1), F.adaptive_max_pool2d(x, 1))
        return torch.cat(pooled, 1).flatten(1)


@pytest.mark.parametrize("head", ["catavgmax", "conv1x1"])
def test_the_deeplift_reference_follows_timm_heads(head):
    # timm's resnet with global_pool='catavgmax' (or 'avgmax') pools by F.adaptive_max_pool2d,
    # and DLA's classifier is a 1×1 convolution then a flatten. The reference took the first's
    # gradient for DeepLIFT's max-pool rule (its map missed f(x) − f(0): padding makes the
    # zero reference's maps uneven), and lost the second's parts at the flatten (the decoupled
    # rule of the output layer not applied; a Linear head gave the library's map).
    torch.manual_seed(0)
    if head == "catavgmax":
        tail = [_CatAvgMax(), nn.Linear(16, 10)]
    else:
        tail = [nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 10, 1), nn.Flatten()]
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, 2, padding=1), nn.BatchNorm2d(8), nn.ReLU(), *tail,
    )  # fmt: skip
    _assert_deeplift_equals_the_reference(model, size=12)


ACTIVATIONS = [
    nn.ReLU6(inplace=True),  # MobileNetV2's
    nn.Hardtanh(-0.5, 2.0),
    nn.LeakyReLU(0.1),
    nn.ELU(),
    nn.SiLU(),
    nn.GELU(),
    nn.GELU("tanh"),
    nn.Hardswish(),
    nn.Hardsigmoid(),
    nn.Mish(),
    nn.Tanh(),
    nn.Sigmoid(),
]


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: repr(a))
def test_deeplift_through_element_wise_activations_equals_the_reference(activation):
    # The zoo's CNNs bring DeepLIFT only ReLUs (the others sit in blocks it refuses): here every
    # element-wise activation, each rule's multiplier Δf/Δx against the float64 reference.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), activation, nn.Conv2d(8, 8, 3),
        activation, nn.MaxPool2d(2), nn.Flatten(), nn.Linear(72, 10), activation,
        nn.Linear(10, 4),
    )  # fmt: skip
    _assert_deeplift_equals_the_reference(model, size=8)


def _assert_deeplift_equals_the_reference(model: nn.Module, size: int) -> None:
    """Every DeepLIFT rule's map on ``size``×``size`` images against the float64 reference.

    The reference keeps the summation-to-delta property for Rescale and RevealCancel.
    """
    model = randomise_batchnorm(model).double().eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, size, size, generator=generator, dtype=torch.float64)
    gain = (model(x) - model(torch.zeros_like(x)))[:, 1].detach()
    for rule in ("rescale", "reveal_cancel", "ablation"):
        reference = zoo_references.reference_deeplift(model, x, rule, 1)
        if rule != "ablation":
            torch.testing.assert_close(reference.sum((1, 2, 3)), gain, rtol=1e-9, atol=1e-12)
        ours = explain(model, x, f"deeplift.{rule}", 1).attribution
        assert (ours - reference).abs().max() <= 1e-9 * reference.abs().max(), rule
