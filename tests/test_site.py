"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors.

Strict mode fails on a page left out of the navigation, a link to a missing page or anchor, and a
docstring that mkdocstrings cannot parse; the tests below check that it does, on a small site
built with the project's own configuration.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OUR_PACKAGES = (
    "explain_core",
    "explain_gradients",
    "explain_coda",
    "explain_capsules",
    "explain_modbp",
    "explain_onnx",
)


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice, not a warning
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config)]
    return subprocess.run(
        [*command, "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=config.parent,
        env=env,
    )


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    api = [page.read_text() for page in (tmp_path / "site" / "api").rglob("index.html")]
    assert len(api) == len(list((DOCS / "api").glob("*.md")))
    # The docstrings' Sphinx roles read as code (docs/hooks/sphinx_roles.py), none as typed.
    typed = [m for page in api for m in re.findall(r":(?:class|func|meth|mod|data|attr):\S+", page)]
    assert not typed, f"Sphinx roles left in the API reference: {typed[:5]}"


def small_site(tmp_path: Path, page: str, module: str) -> Path:
    """A site with one page and one module, built with the project's own settings."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(page)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "small.py").write_text(module)
    config.update(docs_dir="docs", nav=[{"Home": "index.md"}])
    for key in ("hooks", "exclude_docs"):
        config.pop(key)
    (python,) = [p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict)]
    handler = python["handlers"]["python"]
    handler["paths"] = ["src"]
    extensions = handler["options"]["extensions"]  # the project's, from where they are
    handler["options"]["extensions"] = [str(ROOT / extension) for extension in extensions]
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path


GOOD_MODULE = '''"""A module."""


def double(x: int) -> int:
    """Twice ``x``.

    Args:
        x: A number.

    Returns:
        ``2 * x``.
    """
    return 2 * x
'''


def test_the_small_site_builds(tmp_path):
    config = small_site(tmp_path, "# Home\n\n::: small\n", GOOD_MODULE)
    result = build(config, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("page", "module", "complaint"),
    [
        ("# Home\n\n[gone](missing.md)\n\n::: small\n", GOOD_MODULE, "'missing.md'"),
        ("# Home\n\n[gone](#no-such-heading)\n\n::: small\n", GOOD_MODULE, "#no-such-heading"),
        (
            "# Home\n\n::: small\n",
            GOOD_MODULE.replace("x: A number.", "y: A number."),
            "Parameter 'y' does not appear in the function signature",
        ),
        (
            "# Home\n\n::: small\n",
            GOOD_MODULE.replace("x: A number.", "x: A number.\n        a line without a colon"),
            "Failed to get 'name: description' pair",
        ),
    ],
    ids=["broken-link", "broken-anchor", "unknown-parameter", "unparsable-docstring"],
)
def test_strict_build_fails_on_a_broken_link_or_docstring(tmp_path, page, module, complaint):
    config = small_site(tmp_path, page, module)
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert complaint in result.stdout + result.stderr


def api_directives() -> set[str]:
    """The modules the API reference renders (``::: module`` lines of docs/api/)."""
    return {
        match
        for page in (DOCS / "api").glob("*.md")
        for match in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M)
    }


def public_names(module_name: str) -> dict[str, object]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if getattr(v, "__module__", "") == module_name]
    return {name: getattr(module, name) for name in names if not name.startswith("_")}


def taught_imports() -> list[tuple[str, str, str]]:
    """(source, module, name) for every import of our packages that the docs and examples teach."""
    sources = [ROOT / "README.md", *DOCS.rglob("*.md")]
    blocks = [
        (path.relative_to(ROOT), block)
        for path in sources
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    ]
    blocks += [(p.relative_to(ROOT), p.read_text()) for p in (ROOT / "examples").rglob("*.py")]
    found = []
    for source, code in blocks:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found += [(str(source), node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(str(source), alias.name, "") for alias in node.names]
    return [item for item in found if item[1].split(".")[0] in OUR_PACKAGES]


def test_the_api_reference_documents_what_the_docs_teach_to_import():
    directives = api_directives()
    assert set(OUR_PACKAGES) <= directives
    documented = {
        id(value): module for module in directives for value in public_names(module).values()
    }
    missing = set()
    for source, module, name in taught_imports():
        if module in directives:
            continue
        value = getattr(importlib.import_module(module), name) if name else None
        if not name or id(value) not in documented:
            missing.add(f"{module}.{name} (imported in {source})".replace(". (", " ("))
    assert not missing, "add these to a page of docs/api/: " + ", ".join(sorted(missing))


def test_the_methods_page_lists_every_built_in_method():
    from explain_core import get_registry

    table = re.findall(
        r"^\| `([\w.]+)` \| ([\w-]+) \| (\w+) \|", (DOCS / "methods.md").read_text(), re.M
    )
    built_in = {
        name: (spec.family, spec.plugin)
        for name, spec in get_registry().items()
        if spec.plugin in OUR_PACKAGES
    }
    assert {name: (family, plugin) for name, family, plugin in table} == built_in
