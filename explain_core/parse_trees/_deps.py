"""Lazy imports of the optional ``graphs`` dependencies (networkx, the graphviz package)."""

from __future__ import annotations

import importlib
from types import ModuleType

from explain_core.errors import MissingDependencyError

INSTALL_HINT = "pip install 'explain-torch[graphs]'"


def _require(module: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingDependencyError(
            f"{feature} needs the Python package {module!r}, which is not installed; install "
            f"the graphs extra: {INSTALL_HINT}"
        ) from error


def require_networkx() -> ModuleType:
    """Import networkx, or raise :class:`MissingDependencyError` naming the extra to install."""
    return _require("networkx", "parse-tree graphs")


def require_graphviz() -> ModuleType:
    """Import the graphviz package, or raise :class:`MissingDependencyError`."""
    return _require("graphviz", "rendering parse trees")
