from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, write_user_module
from PIL import Image
from safetensors.torch import save_file
from torch import nn

from explain_core import explain
from explain_core.cli import main
from explain_core.demo import DemoSection, DemoStep
from explain_core.errors import ExplainError, InvalidInputError, ModelLoadError
from explain_core.loading import load_model

EXPLAIN = Path(sys.executable).parent / "explain"
SUBCOMMANDS = ("plugins", "demo", "attribute")


pytestmark = pytest.mark.usefixtures("restore_showwarning")


def assert_one_line_error(err: str, prefix: str = "explain: error:") -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), err
    assert "Traceback" not in err
    return lines[0]


# --- a small project on disk ------------------------------------------------------------------


@dataclass
class Project:
    root: Path
    module: str
    weights: Path
    weight: np.ndarray  # (10, 64)
    bias: np.ndarray  # (10,)
    npy_a: Path
    npy_b: Path
    png: Path

    @property
    def reference(self) -> str:
        return f"{self.module}:build"

    def base_args(self, *inputs: Path, out: Path | None = None) -> list[str]:
        return [
            "attribute",
            *map(str, inputs or (self.npy_a, self.npy_b)),
            "--model",
            self.reference,
            "--weights",
            str(self.weights),
            "--out",
            str(out or self.root / "out"),
        ]

    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.weight.astype(np.float64) @ x.reshape(-1).astype(np.float64) + self.bias

    def input_x_gradient(self, x: np.ndarray, target: int) -> np.ndarray:
        # For Linear(64, 10) after Flatten: d out[t] / d x = W[t], so x * grad = x * W[t].
        return x * self.weight[target].reshape(x.shape)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    module = write_user_module(
        tmp_path,
        monkeypatch,
        "tinymodels",
        "from torch import nn\n\n\n"
        "def build():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))\n",
    )
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(10, 64, generator=generator)
    bias = torch.randn(10, generator=generator) * 0.1
    save_file({"1.weight": weight, "1.bias": bias}, str(tmp_path / "weights.safetensors"))
    rng = np.random.default_rng(3)
    np.save(tmp_path / "a.npy", rng.uniform(0, 1, size=(1, 8, 8)).astype(np.float32))
    np.save(tmp_path / "b.npy", rng.uniform(-1, 1, size=(1, 8, 8)).astype(np.float32))
    pixels = rng.integers(0, 256, size=(8, 8), dtype=np.uint8)
    Image.fromarray(pixels, mode="L").save(tmp_path / "digit.png")
    return Project(
        root=tmp_path,
        module=module,
        weights=tmp_path / "weights.safetensors",
        weight=weight.numpy(),
        bias=bias.numpy(),
        npy_a=tmp_path / "a.npy",
        npy_b=tmp_path / "b.npy",
        png=tmp_path / "digit.png",
    )


def assert_no_outputs(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


# --- help, version, usage errors --------------------------------------------------------------


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    assert out.startswith("usage: explain")
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_subcommand_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli([command, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: explain {command}")
    assert "--debug" in out
    assert err == ""


def test_attribute_help_lists_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_cli(["attribute", "--help"], capsys)
    for flag in ("--model", "--weights", "--method", "--out", "--target", "--channels", "--option"):
        assert flag in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0
    assert out == f"explain {metadata.version('explain-torch')}\n"
    assert re.fullmatch(r"explain \d+\.\d+\S*\n", out)


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli([], capsys)
    assert code == 0
    assert out.startswith("usage: explain")
    assert "attribute" in out
    assert err == ""


@pytest.mark.parametrize(
    ("argv", "help_command"),
    [
        (["frobnicate"], "explain --help"),
        (["--bogus"], "explain --help"),
        (["plugins", "--bogus"], "explain plugins --help"),
        (["demo", "--quick", "--nope=1"], "explain demo --help"),
        (
            ["attribute", "x.npy", "--model", "m:f", "--method", "gradient", "--out", "o", "--zzz"],
            "explain attribute --help",
        ),
        (
            ["parse-tree", "--model", "m:f", "--out", "t.svg", "--option", "x=1"],
            "explain parse-tree --help",
        ),
    ],
)
def test_usage_errors_are_one_line(
    argv: list[str], help_command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert out == ""
    line = assert_one_line_error(err, prefix="explain")
    assert ": error: " in line
    # The hint names the help that lists the options of the command given.
    assert line.endswith(f"(see {help_command})"), line


def test_unknown_subcommand_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = run_cli(["frobnicate"], capsys)
    assert "'frobnicate'" in err and "attribute" in err


def test_missing_required_argument_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["attribute", "x.npy", "--method", "gradient"], capsys)
    assert code == 2
    line = assert_one_line_error(err, prefix="explain attribute: error:")
    assert "--out" in line
    code, _, err = run_cli(["attribute", "x.npy", "--method", "gradient", "--out", "o"], capsys)
    assert code == 2
    line = assert_one_line_error(err, prefix="explain attribute: error:")
    assert "--model" in line and "--hf" in line  # one of them


def test_bad_choice_for_channels(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["attribute", "x.npy", "--model", "m:f", "--method", "g", "--out", "o"]
    argv += ["--channels", "2"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_line_error(err, prefix="explain attribute: error:")


# --- plugins ----------------------------------------------------------------------------------


def test_plugins_lists_gradient_methods(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plugins"], capsys)
    assert code == 0
    assert re.search(r"^explain_gradients \S+ \(", out, re.MULTILINE)
    names = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert {"gradient", "input_x_gradient", "integrated_gradients"} <= names


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plugins", "--json"], capsys)
    assert code == 0
    payload = json.loads(out)
    by_name = {entry["name"]: entry for entry in payload}
    gradients = by_name["explain_gradients"]
    assert gradients["error"] is None
    methods = {m["name"]: m for m in gradients["methods"]}
    assert methods["gradient"]["family"] == "gradient"
    assert "input_x_gradient" in methods
    assert all(m["summary"] for m in methods.values())


# --- attribute: success -----------------------------------------------------------------------


def test_attribute_npy_end_to_end(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = project.root / "out"
    argv = [*project.base_args(), "--method", "input_x_gradient"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    model = load_model(project.reference, project.weights)
    for line, path in zip(lines, (project.npy_a, project.npy_b), strict=True):
        x = np.load(path)
        target = int(np.argmax(project.logits(x)))
        assert line.startswith(f"{path}: input_x_gradient for class {target} (score ")
        saved = np.load(out_dir / f"{path.stem}.npy")
        assert saved.shape == (1, 8, 8)
        np.testing.assert_allclose(saved, project.input_x_gradient(x, target), atol=1e-6)
        reference = explain(model, torch.from_numpy(x)[None], "input_x_gradient")
        np.testing.assert_allclose(saved, reference.attribution[0].numpy(), atol=1e-6)
        with Image.open(out_dir / f"{path.stem}.png") as image:
            assert image.format == "PNG"
            assert image.size[0] > 400  # the overlay with its colour bar (tests/test_plots.py)
    assert sorted(p.name for p in out_dir.iterdir()) == ["a.npy", "a.png", "b.npy", "b.png"]


def test_attribute_png_with_channels(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = project.root / "pngout"
    argv = [
        *project.base_args(project.png, out=out_dir),
        "--method",
        "input_x_gradient",
        "--channels",
        "1",
    ]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert len(out.splitlines()) == 1
    with Image.open(project.png) as image:
        x = (np.asarray(image, dtype=np.float32) / 255.0)[None]
    target = int(np.argmax(project.logits(x)))
    assert f"for class {target} " in out
    saved = np.load(out_dir / "digit.npy")
    np.testing.assert_allclose(saved, project.input_x_gradient(x, target), atol=1e-6)
    assert (out_dir / "digit.png").is_file()


def test_attribute_target_option(project: Project, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*project.base_args(project.npy_a), "--method", "input_x_gradient", "--target", "3"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "for class 3 " in out
    x = np.load(project.npy_a)
    score = project.logits(x)[3]
    assert f"(score {score:.4g})" in out
    saved = np.load(project.root / "out" / "a.npy")
    np.testing.assert_allclose(saved, project.input_x_gradient(x, 3), atol=1e-6)


def test_attribute_integrated_gradients_with_option(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        *project.base_args(),
        "--method",
        "integrated_gradients",
        "--option",
        "steps=8",
        "--target",
        "5",
    ]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert len(out.splitlines()) == 2
    model = load_model(project.reference, project.weights)
    for path in (project.npy_a, project.npy_b):
        x = np.load(path)
        saved = np.load(project.root / "out" / f"{path.stem}.npy")
        # A linear model has a constant gradient: IG from a zero baseline is x * W[t].
        np.testing.assert_allclose(saved, project.input_x_gradient(x, 5), atol=1e-5)
        reference = explain(model, torch.from_numpy(x)[None], "integrated_gradients", 5, steps=8)
        np.testing.assert_allclose(saved, reference.attribution[0].numpy(), atol=1e-6)


def test_attribute_same_stem_gets_unique_names(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    other = project.root / "sub"
    other.mkdir()
    np.save(other / "a.npy", np.zeros((1, 8, 8), dtype=np.float32))
    argv = [*project.base_args(project.npy_a, other / "a.npy"), "--method", "gradient"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    out_dir = project.root / "out"
    assert sorted(p.name for p in out_dir.iterdir()) == ["a-2.npy", "a-2.png", "a.npy", "a.png"]
    # gradient of a linear model does not depend on x: both maps are W[t] for their target.
    first = np.load(out_dir / "a.npy")
    target = int(np.argmax(project.logits(np.load(project.npy_a))))
    np.testing.assert_allclose(first[0], project.weight[target].reshape(8, 8), atol=1e-6)


# --- attribute: failures ----------------------------------------------------------------------


def _write_broken_module(root: Path) -> str:
    name = f"brokenmodels_{uuid.uuid4().hex}"
    (root / f"{name}.py").write_text("raise ImportError('needs a missing dependency')\n")
    importlib.invalidate_caches()
    return name


def _failure_cases(project: Project) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    root = project.root
    (root / "notes.txt").write_text("not an input")
    np.save(root / "small.npy", np.zeros((1, 4, 4), dtype=np.float32))
    whole = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    torch.save(whole, root / "whole.pt")
    (root / "afile").write_text("I am a regular file")
    broken = _write_broken_module(root)
    base = project.base_args()
    method = ["--method", "input_x_gradient"]
    return {
        "unknown method": (
            [*base, "--method", "gradiant"],
            ("unknown method 'gradiant'", "'gradient'"),
        ),
        "missing input": (
            [*project.base_args(project.npy_a, root / "missing.npy"), *method],
            ("missing.npy", "does not exist"),
        ),
        "unreadable input": (
            [*project.base_args(root / "notes.txt"), *method],
            ("notes.txt", ".npy"),
        ),
        "different shapes": (
            [*project.base_args(project.npy_a, root / "small.npy"), *method],
            ("one shape", "a.npy", "small.npy", "(1, 4, 4)"),
        ),
        "missing weights": (
            [*base[:-4], "--weights", str(root / "nope.safetensors"), *base[-2:], *method],
            ("nope.safetensors", "does not exist"),
        ),
        "pickled model": (
            [*base[:-4], "--weights", str(root / "whole.pt"), *base[-2:], *method],
            ("refusing", "whole.pt", "state_dict"),
        ),
        "malformed option": ([*base, *method, "--option", "steps"], ("KEY=VALUE", "'steps'")),
        "unknown option": (
            [*base, *method, "--option", "bogus=1"],
            ("no option 'bogus'", "input_x_gradient"),
        ),
        "invalid option value": (
            [*base, "--method", "integrated_gradients", "--option", "steps=0"],
            ("invalid options", "steps"),
        ),
        "target out of range": ([*base, *method, "--target", "10"], ("target", "[0, 9]")),
        "unwritable out": (
            [*base[:-1], str(root / "afile" / "out"), *method],
            ("cannot create output folder", "afile"),
        ),
        "module fails to import": (
            [*base[:-6], "--model", f"{broken}:build", *base[-4:], *method],
            ("cannot import", broken, "needs a missing dependency"),
        ),
        "malformed model reference": (
            [*base[:-6], "--model", "nocolon", *base[-4:], *method],
            ("package.module:factory",),
        ),
        "factory typo": (
            [*base[:-6], "--model", f"{project.module}:buld", *base[-4:], *method],
            ("has no attribute 'buld'", "did you mean 'build'?"),
        ),
        "weights folder": (
            [*base[:-4], "--weights", str(root), *base[-2:], *method],
            ("is a folder, not a file", "weights file itself", ".safetensors"),
        ),
        "input folder": (
            [*project.base_args(root), *method],
            ("is a folder, not a file", "image or .npy files"),
        ),
    }


FAILURES = (
    "unknown method",
    "missing input",
    "unreadable input",
    "different shapes",
    "missing weights",
    "pickled model",
    "malformed option",
    "unknown option",
    "invalid option value",
    "target out of range",
    "unwritable out",
    "module fails to import",
    "malformed model reference",
    "factory typo",
    "weights folder",
    "input folder",
)


@pytest.mark.parametrize("case", FAILURES)
def test_attribute_failures_are_one_line(
    case: str, project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, keywords = _failure_cases(project)[case]
    before = sorted(p.name for p in project.root.iterdir())
    code, out, err = run_cli(argv, capsys)
    assert code == 1, (out, err)
    assert out == ""
    line = assert_one_line_error(err)
    for keyword in keywords:
        assert keyword in line, (keyword, line)
    out_dir = Path(argv[argv.index("--out") + 1])
    if out_dir.parent.is_dir():
        assert_no_outputs(out_dir)
    # Nothing new beside it either (no temporary files); an empty out folder is tolerated.
    ignored = {"__pycache__", out_dir.name}
    after = sorted(p.name for p in project.root.iterdir() if p.name not in ignored)
    assert after == [name for name in before if name not in ignored]


def test_failure_keeps_earlier_outputs(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = project.root / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("earlier")
    code, _, err = run_cli([*project.base_args(), "--method", "gradiant"], capsys)
    assert code == 1
    assert_one_line_error(err)
    assert sorted(p.name for p in out_dir.iterdir()) == ["keep.txt"]
    assert (out_dir / "keep.txt").read_text() == "earlier"


@pytest.mark.parametrize("position", ["before", "after"])
def test_debug_reraises(
    position: str, project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*project.base_args(), "--method", "gradiant"]
    argv = ["--debug", *argv] if position == "before" else [*argv, "--debug"]
    with pytest.raises(ExplainError, match="gradiant"):
        main(argv)


def test_debug_reraises_load_error(project: Project) -> None:
    argv = [*project.base_args(), "--method", "gradient", "--model", "nocolon", "--debug"]
    with pytest.raises(ModelLoadError):
        main(argv)


def test_without_weights_a_note_says_so(
    project: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*project.base_args(), "--method", "input_x_gradient"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and err == ""  # weights given: nothing to say
    at = argv.index("--weights")
    without = argv[:at] + argv[at + 2 :]
    code, out, err = run_cli(without, capsys)
    assert code == 0 and len(out.splitlines()) == 2
    line = assert_one_line_error(err, prefix="explain: note:")
    assert "no --weights" in line and project.reference in line and "factory" in line
    # A failing run says only what failed.
    code, _, err = run_cli([*without, "--target", "10"], capsys)
    assert code == 1 and "target" in assert_one_line_error(err)


# --- demo -------------------------------------------------------------------------------------


def _hidden_staging(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _check_demo_folder(out_dir: Path) -> None:
    report = (out_dir / "report.md").read_text(encoding="utf-8")
    summary = json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))
    assert "sections" in summary and "not_yet_available" in summary
    assert isinstance(summary["sections"], dict) and summary["sections"]
    assert summary["quick"] is True
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert figures, report
    for figure in figures:
        with Image.open(out_dir / figure) as image:
            assert image.format == "PNG"
    for missing in summary["not_yet_available"]:
        assert f"- {missing}" in report


def test_demo_quick_writes_report_and_replaces(
    quick_demo_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The console script's run (conftest.py, shared with tests/test_demo.py) wrote the folder.
    earlier, stdout = quick_demo_run
    assert f"wrote {earlier / 'report.md'}" in stdout
    _check_demo_folder(earlier)
    assert _hidden_staging(earlier.parent) == []
    # A run in this process replaces an earlier output (stale files disappear).
    out_dir = tmp_path / "demo"
    shutil.copytree(earlier, out_dir)
    (out_dir / "stale.txt").write_text("from an earlier run")
    code, out, err = run_cli(["demo", "--quick", "--out", str(out_dir)], capsys)
    assert code == 0, err
    assert f"wrote {out_dir / 'report.md'}" in out
    _check_demo_folder(out_dir)
    assert not (out_dir / "stale.txt").exists()
    assert _hidden_staging(tmp_path) == []


def test_demo_refuses_foreign_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "precious"
    out_dir.mkdir()
    (out_dir / "thesis.tex").write_text("do not delete")
    code, out, err = run_cli(["demo", "--quick", "--out", str(out_dir)], capsys)
    assert code == 1
    assert "wrote" not in out
    line = assert_one_line_error(err)
    assert "not an earlier demo output" in line and "precious" in line
    assert sorted(p.name for p in out_dir.iterdir()) == ["thesis.tex"]
    assert (out_dir / "thesis.tex").read_text() == "do not delete"
    assert _hidden_staging(tmp_path) == []


def test_demo_refuses_regular_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "report"
    target.write_text("a file")
    code, _, err = run_cli(["demo", "--quick", "--out", str(target)], capsys)
    assert code == 1
    assert_one_line_error(err)
    assert target.read_text() == "a file"


class _QuickStep(DemoStep):
    title = "Quick step"
    order = 0

    def run(self, context):
        (context.out_dir / "quick.txt").write_text("written")
        return DemoSection(self.title, lines=["ok"])


class _FailingStep(DemoStep):
    title = "Failing step"
    plugin = "broken_plugin"

    def run(self, context):
        (context.out_dir / "partial.png").write_bytes(b"half")
        raise InvalidInputError("the failing step failed")


class _FakeManager:
    """The real plugins' commands, and a demo step that fails."""

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def demo_steps(self):
        return [_FailingStep()]


def test_a_failing_demo_step_is_reported_and_leaves_no_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import explain_core.data.showcase as showcase
    import explain_core.plugin_manager as plugin_manager

    monkeypatch.setattr(showcase, "BundledDataStep", _QuickStep)
    fake = _FakeManager(plugin_manager.get_plugin_manager())
    monkeypatch.setattr(plugin_manager, "get_plugin_manager", lambda: fake)
    out_dir = tmp_path / "demo"
    out_dir.mkdir()
    (out_dir / "summary.json").write_text("{}")  # an earlier demo output
    (out_dir / "report.md").write_text("earlier report")
    code, _, err = run_cli(["demo", "--quick", "--out", str(out_dir)], capsys)
    assert code == 1
    line = assert_one_line_error(err)
    assert "section 'Failing step' failed: InvalidInputError: the failing step failed" in line
    # The new report, with the step shown as failed; the file it wrote before failing is gone.
    assert sorted(p.name for p in out_dir.iterdir()) == ["report.html", "report.md", "summary.json"]
    assert (
        "**Failed**: InvalidInputError: the failing step failed"
        in (out_dir / "report.md").read_text()
    )
    assert _hidden_staging(tmp_path) == []


# --- the installed console script -------------------------------------------------------------


def _script(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    assert EXPLAIN.is_file(), EXPLAIN
    return subprocess.run(
        [str(EXPLAIN), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_console_script_version_and_usage_error(tmp_path: Path) -> None:
    result = _script(["--version"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"explain {metadata.version('explain-torch')}\n"
    result = _script(["frobnicate"], tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert_one_line_error(result.stderr)


def test_console_script_ends_quietly_when_the_reader_goes_away(tmp_path: Path) -> None:
    # `explain plugins | head -2`: the reader is gone before anything is written.
    process = subprocess.Popen(
        [str(EXPLAIN), "plugins"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1, err
    assert err == ""  # no "Broken pipe" error, no "Exception ignored" at exit


def test_a_broken_pipe_while_running_ends_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `explain plugins | head -2`: the listing's print fails once the reader is gone.
    from explain_core.cli import plugins

    def listing(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(plugins, "run", listing)
    code, _, err = run_cli(["plugins"], capsys)
    assert code == 1 and err == ""


def test_console_script_attribute(project: Project) -> None:
    # The model module is found in the working folder without touching PYTHONPATH.
    args = [*project.base_args(), "--method", "input_x_gradient"]
    result = _script(args, project.root)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    x = np.load(project.npy_b)
    target = int(np.argmax(project.logits(x)))
    saved = np.load(project.root / "out" / "b.npy")
    np.testing.assert_allclose(saved, project.input_x_gradient(x, target), atol=1e-6)
    # A user error: one line, no traceback, exit 1.
    result = _script([*args[:-1], "gradiant"], project.root)
    assert result.returncode == 1
    assert_one_line_error(result.stderr)
    assert "did you mean" in result.stderr
