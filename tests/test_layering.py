"""The layering rules, checked on the source of every package (with Python's own parser).

- The core imports no plugin or exporter package (not lazily, not under ``TYPE_CHECKING``) and
  names none, not even in a string or a docstring.
- The core names no registered method in its code (a string equal to a method's name).
- No package imports another package's private (``_``) names, and every name a package imports
  from another is in that module's ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

from explain_core import get_registry

ROOT = Path(__file__).resolve().parents[1]
CORE = "explain_core"
PACKAGES = {
    "explain_core": ROOT / "explain_core",
    "explain_gradients": ROOT / "plugins" / "explain_gradients",
    "explain_coda": ROOT / "plugins" / "explain_coda",
    "explain_capsules": ROOT / "plugins" / "explain_capsules",
    "explain_modbp": ROOT / "plugins" / "explain_modbp",
    "explain_onnx": ROOT / "exporters" / "explain_onnx",
}
PLUGINS = [name for name in PACKAGES if name != CORE]


def modules(package: str) -> list[tuple[str, ast.Module]]:
    """``(path, tree)`` of every module of ``package``."""
    root = PACKAGES[package]
    return [
        (str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path)))
        for path in sorted(root.rglob("*.py"))
    ]


def imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import statement, at any depth (functions, ``if``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def strings(tree: ast.Module) -> list[str]:
    """Every string constant, docstrings and comments' neighbours included."""
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_the_core_imports_no_plugin_or_exporter():
    offending = [
        f"{path}: {module}"
        for path, tree in modules(CORE)
        for module, _ in imports(tree)
        if module.split(".")[0] in PLUGINS
    ]
    assert not offending


def test_the_core_names_no_plugin_package_even_in_strings():
    offending = [
        f"{path}: {plugin!r} in {text[:60]!r}"
        for path, tree in modules(CORE)
        for text in strings(tree)
        for plugin in PLUGINS
        if plugin in text
    ]
    assert not offending


def test_the_core_names_no_registered_method():
    methods = set(get_registry())
    offending = [
        f"{path}: {text!r}"
        for path, tree in modules(CORE)
        for text in strings(tree)
        if text in methods
    ]
    assert not offending


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_package_imports_private_names_of_another(package):
    offending = []
    for path, tree in modules(package):
        for module, names in imports(tree):
            top = module.split(".")[0]
            if top == package or top not in PACKAGES:
                continue
            if any(part.startswith("_") for part in module.split(".")):
                offending.append(f"{path}: imports the private module {module}")
            offending += [f"{path}: {module}.{n}" for n in names if n.startswith("_")]
    assert not offending


@pytest.mark.parametrize("package", list(PACKAGES))
def test_names_imported_from_another_package_are_in_its_all(package):
    offending = []
    for path, tree in modules(package):
        for module, names in imports(tree):
            top = module.split(".")[0]
            if top == package or top not in PACKAGES or not names:
                continue
            imported = importlib.import_module(module)
            exported = getattr(imported, "__all__", None)
            missing = [
                name
                for name in names
                if not isinstance(getattr(imported, name, None), ModuleType)  # a submodule
                and (exported is None or name not in exported)
            ]
            offending += [f"{path}: {module}.{name}" for name in missing]
    assert not offending
