"""The distributions, built as a release builds them and checked as PyPI checks them.

``python -m build`` writes the sdist, then builds the wheel from the unpacked sdist, so a file the
sdist lacks breaks the wheel too. ``--no-isolation`` builds with the setuptools of this
environment (the dev extra installs it): nothing is downloaded and it takes seconds. Both are
built once for the module, from a copy of the checkout's source files (git's list), so that the
build writes nothing into the checkout. Outside a git checkout the module is skipped.
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "explain_torch"
# The distribution's top-level packages and the folders that hold them in the source tree.
PACKAGES = {
    "explain_core": "explain_core",
    "explain_gradients": "plugins/explain_gradients",
    "explain_coda": "plugins/explain_coda",
    "explain_capsules": "plugins/explain_capsules",
    "explain_modbp": "plugins/explain_modbp",
    "explain_onnx": "exporters/explain_onnx",
}
# Tracked files that are repository housekeeping, not source: the only ones an sdist may lack.
NOT_IN_SDIST = {".gitignore"}


def project_version() -> str:
    """The version written in pyproject.toml: the one place a version is written."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version = "([^"]+)"$', text, re.M)
    assert match, 'pyproject.toml\'s [project] table writes the version as version = "X.Y.Z"'
    return match.group(1)


def tracked_files() -> list[str]:
    """The source files of this checkout: tracked or new, not ignored, present on disk."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: which files are source is unknown")
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return [name for name in listing.stdout.split("\0") if name and (ROOT / name).is_file()]


def run(command: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300, **kwargs)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    return result


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path

    def wheel_names(self) -> list[str]:
        with zipfile.ZipFile(self.wheel) as archive:
            return archive.namelist()

    def wheel_text(self, name: str) -> str:
        with zipfile.ZipFile(self.wheel) as archive:
            return archive.read(name).decode()

    def metadata(self) -> Message:
        return email.message_from_string(
            self.wheel_text(f"{DISTRIBUTION}-{project_version()}.dist-info/METADATA")
        )

    def sdist_names(self) -> set[str]:
        prefix = f"{DISTRIBUTION}-{project_version()}/"
        with tarfile.open(self.sdist) as archive:
            return {m.name.removeprefix(prefix) for m in archive.getmembers() if m.isfile()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    # Built from a clean copy of the source: setuptools also packs the files listed in a stale
    # explain_torch.egg-info/SOURCES.txt of the checkout, which would hide a MANIFEST.in gap.
    source = tmp_path_factory.mktemp("source")
    for name in tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)]
    run(command, source)
    (sdist,) = out.glob(f"{DISTRIBUTION}-*.tar.gz")
    (wheel,) = out.glob(f"{DISTRIBUTION}-*.whl")
    return Built(sdist, wheel)


def test_the_distributions_carry_the_version_of_pyproject(built: Built) -> None:
    version = project_version()
    assert built.sdist.name == f"{DISTRIBUTION}-{version}.tar.gz"
    assert built.wheel.name == f"{DISTRIBUTION}-{version}-py3-none-any.whl"
    assert built.metadata()["Version"] == version


def test_twine_check_strict_passes(built: Built) -> None:
    # --strict turns warnings (a missing or unrenderable long description) into failures.
    result = run(
        [sys.executable, "-m", "twine", "check", "--strict", str(built.sdist), str(built.wheel)],
        ROOT,
    )
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_wheel_metadata_has_the_readme_and_the_license(built: Built) -> None:
    metadata = built.metadata()
    assert metadata["Name"] == "explain-torch"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == (ROOT / "README.md").read_text().strip()
    assert (metadata["License-Expression"] or metadata["License"]) == "MIT"
    names = built.wheel_names()
    # No license file today (the license is the metadata's text); once one is written, it ships.
    for path in [*ROOT.glob("LICEN[CS]E*"), *ROOT.glob("COPYING*")]:
        assert any(name.endswith(f".dist-info/licenses/{path.name}") for name in names)


def test_wheel_has_only_distinctly_named_top_level_packages(built: Built) -> None:
    names = built.wheel_names()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == set(PACKAGES)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = built.wheel_text(entry_points)
    assert "explain = explain_core.cli:main" in text
    for package in ("explain_gradients", "explain_coda", "explain_capsules", "explain_modbp"):
        assert f"{package} = {package}" in text
    assert "explain_onnx = explain_onnx.plugin" in text


def test_wheel_holds_every_file_of_every_package_and_its_py_typed(built: Built) -> None:
    # Every file git tracks inside a package folder (modules, py.typed, any data a module reads
    # at run time) must land in the wheel at its import path.
    names = set(built.wheel_names())
    for package in PACKAGES:
        assert f"{package}/py.typed" in names, f"{package} does not ship its py.typed marker"
    expected = set()
    for path in tracked_files():
        for package, folder in PACKAGES.items():
            if path.startswith(f"{folder}/"):
                expected.add(package + path.removeprefix(folder))
    assert {f"{package}/py.typed" for package in PACKAGES} <= expected
    assert sorted(expected - names) == []


def test_sdist_holds_the_whole_source(built: Built) -> None:
    names = built.sdist_names()
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md", "MANIFEST.in", "PKG-INFO"):
        assert name in names
    missing = sorted(set(tracked_files()) - NOT_IN_SDIST - names)
    assert missing == [], "add them to MANIFEST.in"
    assert any(name.startswith("tests/test_") for name in names)
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_the_installed_wheel_runs(built: Built, tmp_path: Path) -> None:
    # The wheel installed into a folder of its own and put first on the path (the dependencies
    # come from this environment): its code, not the checkout's, loads its plugins and explains.
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile"]
    run([*pip, "--quiet", "--target", str(target), str(built.wheel)], tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target)}
    version = project_version()

    cli = [sys.executable, "-W", "error", str(target / "bin" / "explain")]
    assert run([*cli, "--version"], tmp_path, env=env).stdout == f"explain {version}\n"
    listing = run([*cli, "plugins"], tmp_path, env=env).stdout
    for package in PACKAGES:
        assert f"{package} {version} (built-in)" in listing

    code = (
        "import sys, torch, explain_core\n"
        f"packages = {sorted(PACKAGES)!r}\n"
        "for name in packages: __import__(name)\n"
        "print(sorted({sys.modules[name].__file__.startswith(sys.argv[1]) for name in packages}))\n"
        "print(explain_core.__version__)\n"
        "model = torch.nn.Linear(3, 2, bias=False).double().eval()\n"
        "x = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)\n"
        "relevance = explain_core.explain(model, x, 'lrp.z', target=1).attribution\n"
        "# LRP-0 on one bias-free linear layer is x times the target's weights.\n"
        "torch.testing.assert_close(relevance, (x * model.weight[1]).detach())\n"
    )
    result = run([sys.executable, "-W", "error", "-c", code, str(target)], tmp_path, env=env)
    assert result.stdout.splitlines() == ["[True]", version]


def test_one_version_source() -> None:
    # pyproject.toml writes the version; the packages read it from the installed metadata.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "dynamic" not in re.search(r"\[project\](.*?)\n\[", pyproject, re.S).group(1)
    literal = re.compile(r"^\s*__version__\s*(:[^=]*)?=\s*['\"]", re.M)
    for path in tracked_files():
        if path.endswith(".py") and path.startswith(tuple(PACKAGES.values())):
            assert not literal.search((ROOT / path).read_text()), f"{path} writes a version"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(project_version())}\]", changelog, re.M), (
        "CHANGELOG.md has no section for the version in pyproject.toml"
    )
