"""The optional dependencies of the exporter, imported only when a feature needs them.

``onnx``, ``onnxscript`` (needed by ``torch.onnx``'s exporter) and ``onnxruntime`` come from the
``onnx`` extra (``pip install 'explain-torch[onnx]'``), or with ``onnxruntime-gpu`` from the
``gpu`` extra. The onnxruntime distributions all install the same ``onnxruntime`` module, so two
of them installed together overwrite each other's files: that is refused with a clear error.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

from explain_core.errors import MissingDependencyError, RuntimeConflictError

INSTALL_HINT = "pip install 'explain-torch[onnx]' (or 'explain-torch[gpu]' for onnxruntime-gpu)"

# Distributions that provide the ``onnxruntime`` module; at most one may be installed.
RUNTIME_DISTRIBUTIONS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-training",
)


def require(module: str) -> ModuleType:
    """Import an optional dependency, or raise an error that says how to install it.

    Raises:
        MissingDependencyError: If the module is not installed.
        RuntimeConflictError: For ``onnxruntime`` when several runtime distributions are
            installed.
    """
    if module == "onnxruntime":
        check_single_runtime()
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingDependencyError(
            f"ONNX export needs the {module!r} package, which is not installed ({error}); "
            f"install it with {INSTALL_HINT}"
        ) from error


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_runtimes() -> dict[str, str]:
    """The onnxruntime distributions installed, ``{name: version}``."""
    found = {}
    for name in RUNTIME_DISTRIBUTIONS:
        version = _distribution_version(name)
        if version is not None:
            found[name] = version
    return found


def check_single_runtime() -> None:
    """Refuse an environment with more than one onnxruntime distribution.

    Raises:
        RuntimeConflictError: Naming the distributions found and how to repair the environment.
    """
    found = installed_runtimes()
    if len(found) > 1:
        listed = ", ".join(f"{name} {version}" for name, version in found.items())
        raise RuntimeConflictError(
            f"several onnxruntime distributions are installed ({listed}); they share the "
            "'onnxruntime' module and overwrite each other's files. Keep exactly one: "
            f"pip uninstall -y {' '.join(found)} && pip install onnxruntime (CPU) or "
            "onnxruntime-gpu (CUDA)"
        )
