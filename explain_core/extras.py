"""Optional dependencies: imported by the features that need them, with the extra to install.

``pip install explain-torch`` brings torch, numpy, pluggy, safetensors and tqdm only. Everything
else belongs to a named extra (``pip install 'explain-torch[plots]'``; ``[all]`` for every one),
and a feature whose extra is missing raises one :class:`~explain_core.errors.MissingDependencyError`
naming it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from explain_core.errors import MissingDependencyError

__all__ = ["EXTRAS", "require"]

EXTRAS: dict[str, tuple[str, str]] = {
    "sklearn": ("scikit-learn", "data"),
    "skimage": ("scikit-image", "metrics"),
    "matplotlib": ("matplotlib", "plots"),
    "PIL": ("pillow", "plots"),
    "torch_pruning": ("torch-pruning", "capsules"),
    "networkx": ("networkx", "graphs"),
    "graphviz": ("graphviz", "graphs"),
    "onnx": ("onnx", "onnx"),
    "onnxscript": ("onnxscript", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
}
"""Import name → (distribution, extra that installs it)."""


def require(module: str, feature: str) -> ModuleType:
    """Import an optional dependency (or one of its submodules, ``"skimage.metrics"``).

    Args:
        module: The module to import.
        feature: What needs it, for the message (``"the SSIM metrics"``).

    Raises:
        MissingDependencyError: If it is not installed, naming the extra that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        distribution, extra = EXTRAS[module.split(".")[0]]
        raise MissingDependencyError(
            f"{feature} needs the Python package {distribution!r}, which is not installed: "
            f"pip install 'explain-torch[{extra}]' (or 'explain-torch[all]')"
        ) from error
