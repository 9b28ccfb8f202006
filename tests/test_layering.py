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


def imports_from_other_packages(package: str) -> list[tuple[str, str, list[str]]]:
    """``(path, module, names)`` of every import ``package`` makes from another package."""
    return [
        (path, module, names)
        for path, tree in modules(package)
        for module, names in imports(tree)
        if module.split(".")[0] in PACKAGES and module.split(".")[0] != package
    ]


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_package_imports_private_names_of_another(package):
    offending = []
    for path, module, names in imports_from_other_packages(package):
        if any(part.startswith("_") for part in module.split(".")):
            offending.append(f"{path}: imports the private module {module}")
        offending += [f"{path}: {module}.{n}" for n in names if n.startswith("_")]
    assert not offending


@pytest.mark.parametrize("package", list(PACKAGES))
def test_names_imported_from_another_package_are_in_its_all(package):
    offending = []
    for path, module, names in imports_from_other_packages(package):
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


def _module_name(package: str, path: str) -> str:
    relative = Path(path).relative_to(PACKAGES[package].relative_to(ROOT)).with_suffix("")
    parts = [package, *relative.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles_not_even_through_lazy_imports():
    # Module-level imports form no cycle, and no import inside a function closes one: a lazy
    # import is there to keep optional work out of `import`, never to break a cycle.
    trees = {
        _module_name(package, path): tree for package in PACKAGES for path, tree in modules(package)
    }

    def targets(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Import):
            return {alias.name for alias in node.names} & set(trees)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(trees)
            whole = {node.module} if len(submodules) < len(node.names) else set()
            return (submodules | whole) & set(trees)
        return set()

    eager: dict[str, set[str]] = {name: set() for name in trees}
    lazy: dict[str, set[str]] = {name: set() for name in trees}
    for name, tree in trees.items():
        for node in tree.body:
            body = [node]
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                body = [*node.body, *node.orelse]
            for statement in body:
                eager[name] |= targets(statement)
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    lazy[name] |= targets(node)

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), [start]
        while stack:
            current = stack.pop()
            if current == goal:
                return True
            if current not in seen:
                seen.add(current)
                stack.extend(eager[current])
        return False

    cycles = [f"{a} -> {b}" for a in trees for b in eager[a] if b != a and reaches(b, a)]
    held = [f"{a} -> {b} (lazily)" for a in trees for b in lazy[a] if b != a and reaches(b, a)]
    assert not cycles and not held
