"""Every registered method on every architecture of the zoo: a correct map or one clear error.

The method × architecture table in ``docs/zoo.md`` is this test's output: it is computed here and
must equal the page (``EXPLAIN_WRITE_ZOO_TABLE=1 pytest tests/test_zoo.py`` rewrites it). Exact
checks where a method has an exact property: LRP-0 and CP-LRP conserve on the bias-free twin
(every bias, BatchNorm shift and norm offset zero), DeepLIFT's maps sum to ``f(x) − f(0)``; every
other map must be finite (an all-zero one is marked), its rules being tested layer by layer
elsewhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from zoo import ZOO, bias_free, randomise_batchnorm

from explain_core import explain
from explain_core.errors import ExplainError
from explain_core.plugin_manager import get_registry

PAGE = Path(__file__).resolve().parents[1] / "docs" / "zoo.md"
BEGIN, END = "<!-- zoo-table -->", "<!-- /zoo-table -->"
# Exact properties: conservation on the bias-free twin, or DeepLIFT's summation to delta.
CONSERVING = ("lrp.z", "lrp.cp")
SUMMING = ("deeplift.rescale", "deeplift.reveal_cancel")


def _options(method: str, model: torch.nn.Module, x: torch.Tensor) -> dict:
    if method == "lrp.zb":
        return {"low": 0.0, "high": 1.0}
    if method == "lrp.custom":
        from explain_modbp.composites import lrp_epsilon_plus

        return {"composite": lrp_epsilon_plus()}
    if method in ("patternnet", "pattern_attribution"):
        from explain_modbp.pattern import fit_patterns

        return {"patterns": fit_patterns(model, torch.rand(8, *x.shape[1:]))}
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
    if "CoDA" in message or "DAU" in message:
        return "needs a CoDA-Net"
    if "capsule" in message.lower():
        return "needs a capsule net"
    return "refuses: " + message[:40]


def _cell(method: str, name: str) -> str:
    torch.manual_seed(0)
    model = randomise_batchnorm(ZOO[name]()).eval()
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    try:
        options = _options(method, model, x)
        result = explain(model, x, method, 1, **options)
    except ExplainError as error:
        return _refusal(error)
    assert torch.isfinite(result.attribution).all(), (method, name)
    if method in SUMMING:  # on the model itself: Σ maps = f(x) − f(0), biases and all
        gain = result.output[:, 1] - model(torch.zeros_like(x))[:, 1].detach()
        total = result.attribution.sum((1, 2, 3))
        assert torch.allclose(total, gain, rtol=1e-3, atol=1e-5), (method, name)
        return "✓ sums to f(x) − f(0)"
    if method in CONSERVING:
        twin = bias_free(randomise_batchnorm(ZOO[name]())).double().eval()
        checked = explain(twin, x.double(), method, 1)
        scale = checked.output[:, 1].abs().max()
        assert checked.delta.abs().max() <= 1e-9 * scale + 1e-15, (method, name, checked.delta)
        return "✓ conserves"
    return "runs" if result.attribution.abs().sum() > 0 else "runs (all zero)"


def zoo_table() -> str:
    methods = sorted(get_registry())
    names = list(ZOO)
    rows = ["| method | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    for method in methods:
        rows.append(f"| `{method}` | " + " | ".join(_cell(method, n) for n in names) + " |")
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
