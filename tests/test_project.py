"""Project-level promises: lazy imports, style, README kept true (packaging: test_packaging.py)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_import_and_plugin_loading_do_not_import_optional_dependencies():
    code = (
        "import sys, explain_core, explain_core.data\n"
        "explain_core.get_registry()\n"
        "heavy = ['onnx', 'onnxruntime', 'onnxscript', 'networkx', 'graphviz', 'sklearn',"
        " 'matplotlib', 'torchvision', 'torch_pruning', 'captum', 'skimage']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_cli_help_lists_the_commands_plugins_register():
    # The core's commands and the plugins' come through the same hook.
    code = (
        "from explain_core.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    for command in ("plugins", "demo", "attribute", "check", "evaluate", "parse-tree", "export"):
        assert command in result.stdout


def test_ruff_lint_and_format_pass():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is part of the dev extra; install with pip install -e '.[dev]'"
    lint = subprocess.run([ruff, "check", "."], capture_output=True, text=True, cwd=ROOT)
    assert lint.returncode == 0, lint.stdout
    formatted = subprocess.run(
        [ruff, "format", "--check", "."], capture_output=True, text=True, cwd=ROOT
    )
    assert formatted.returncode == 0, formatted.stdout


def test_results_pages_match_results_files(tmp_path):
    from render_results import render_pages, stale_pages, write_pages

    pages = render_pages()
    assert stale_pages(pages) == [], "run: python benchmarks/render_results.py --update"
    # An edited page and a page no results file makes any more are found, and --update fixes both.
    write_pages(pages, tmp_path)
    (tmp_path / "coda.md").write_text("edited by hand")
    (tmp_path / "left-over.md").write_text("# a page of an old layout")
    assert stale_pages(pages, tmp_path) == ["coda.md", "left-over.md"]
    write_pages(pages, tmp_path)
    assert stale_pages(pages, tmp_path) == []


def test_readme_gives_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Set-up: the two commands.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for script in ("demo.sh", "test.sh", "setup-env.sh"):
        assert (ROOT / "scripts" / script).is_file()


@pytest.mark.parametrize("name", ["explain_gradients", "explain_modbp", "explain_onnx"])
def test_builtin_plugins_are_entry_points_of_the_distribution(name):
    from importlib import metadata

    own = [
        ep
        for ep in metadata.entry_points(group="explain.plugins")
        if ep.dist is not None and ep.dist.name == "explain-torch"
    ]
    assert name in {ep.name for ep in own}


def readme_python_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", readme, re.S)


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_examples_run(index):
    block = readme_python_blocks()[index]
    namespace: dict = {"__name__": f"readme_block_{index}"}
    exec(compile(block, f"README.md python block {index}", "exec"), namespace)


def test_readme_is_what_a_visitor_needs_at_most_15_kb():
    # Details live on the documentation site (docs/); the README says what it is and links there.
    assert len((ROOT / "README.md").read_bytes()) <= 15 * 1024
    assert readme_python_blocks(), "the README has a quickstart that runs"


def test_readme_links_are_relative_paths_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [t for t in targets if not t.startswith(("http://", "https://", "#"))]
    assert local, "the README links the documentation pages"
    missing = [t for t in local if t.startswith("/") or not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README links to paths that do not exist: {missing}"
    pages = {t for t in local if t.startswith("docs/") and t.endswith(".md")}
    assert {"docs/index.md", "docs/getting-started.md"} <= pages
