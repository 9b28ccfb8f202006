"""The core installs and works without any extra; a feature whose extra is missing names it.

The optional packages are made unimportable in a subprocess (``sys.modules[name] = None`` makes
``import name`` raise ``ImportError``), which is what a core-only install looks like to the code.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = [
    "sklearn",
    "skimage",
    "matplotlib",
    "PIL",
    "torch_pruning",
    "networkx",
    "graphviz",
    "onnx",
    "onnxscript",
    "onnxruntime",
]


def run_without_extras(code: str) -> subprocess.CompletedProcess[str]:
    blocker = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in OPTIONAL)
    return subprocess.run(
        [sys.executable, "-c", blocker + code], capture_output=True, text=True, timeout=300
    )


def test_the_core_dependencies_are_torch_numpy_pluggy_safetensors_tqdm():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0] for dep in project["dependencies"]}
    assert names == {"torch", "numpy", "pluggy", "safetensors", "tqdm"}
    extras = project["optional-dependencies"]
    for extra in ("data", "metrics", "plots", "capsules", "graphs", "onnx", "all"):
        assert extra in extras


def test_every_method_family_explains_without_any_extra():
    code = """
import torch
from torch import nn
from explain_core import explain, get_plugin_manager
manager = get_plugin_manager()
assert not [p.error for p in manager.plugins.values() if p.error], manager.plugins
model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 4)).eval()
x = torch.randn(2, 1, 8, 8)
for method in ["gradient", "integrated_gradients", "lrp.epsilon_plus", "deeplift.rescale",
               "guided_bp", "dynamic.contributions"]:
    assert explain(model, x, method).attribution.shape == x.shape, method
from explain_coda import CoDANet, LayerSpec
coda = CoDANet([LayerSpec(4, 3, 3, 1)], (1, 8, 8)).eval()
assert explain(coda, x, "coda.contributions").attribution.shape == x.shape
print("ok")
"""
    result = run_without_extras(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.parametrize(
    ("code", "extra"),
    [
        ("from explain_core.data import load_digits; load_digits()", "data"),
        (
            "import torch; from explain_core.metrics.randomisation import map_ssim\n"
            "map_ssim(torch.rand(2, 8, 8), torch.rand(2, 8, 8))",
            "metrics",
        ),
        (
            "import numpy as np; from explain_core.viz import save_grid\n"
            "save_grid([[np.zeros((2, 2, 3), np.uint8)]], 'x.png')",
            "plots",
        ),
        ("import explain_capsules.compaction", "capsules"),
        (
            "import torch; from explain_core.parse_trees import build_parse_tree\n"
            "build_parse_tree([torch.ones(2, 1)], [torch.ones(2), torch.ones(1)], [0])",
            "graphs",
        ),
    ],
)
def test_a_feature_whose_extra_is_missing_names_the_extra(code, extra):
    result = run_without_extras(code)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("explain_core.errors.MissingDependencyError"), result.stderr
    assert f"pip install 'explain-torch[{extra}]'" in last
