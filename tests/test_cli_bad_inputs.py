"""Bad input to the `explain` command: one line on stderr, a non-zero exit, no traceback.

Covers inputs the model cannot run on, models returning tuples, non-finite weights, output paths
under a file, and `evaluate` options checked when the command line is parsed.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, write_user_module
from PIL import Image
from safetensors.torch import save_file

from explain_core.cli import attribute as attribute_command
from explain_core.cli import main
from explain_core.errors import InvalidInputError

pytestmark = pytest.mark.usefixtures("restore_showwarning", "one_torch_thread")

MODELS = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 10)
    )


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = build()

    def forward(self, x):
        return self.net(x), 0


def pair():
    return _Pair()
"""


class Project:
    """A user's folder: a model module, weights, good and bad inputs, a file ``afile``."""

    def __init__(self, root: Path, module: str) -> None:
        self.root = root
        self.module = module
        self.afile = root / "afile"
        self.afile.write_text("a regular file")
        np.save(root / "x.npy", np.random.rand(1, 8, 8).astype(np.float32))
        np.save(root / "x3.npy", np.random.rand(3, 8, 8).astype(np.float32))
        np.save(root / "x10.npy", np.random.rand(1, 10, 10).astype(np.float32))
        np.save(root / "x64.npy", np.random.rand(64).astype(np.float32))
        np.save(root / "empty.npy", np.zeros((0, 8, 8), np.float32))
        rgb = (np.random.rand(8, 8, 3) * 255).astype(np.uint8)
        Image.fromarray(rgb).save(root / "rgb.png")
        state = importlib.import_module(module).build().state_dict()
        save_file({k: v * float("nan") for k, v in state.items()}, root / "nan.safetensors")

    def attribute(
        self, *inputs: str, model: str = "build", extra: tuple[str, ...] = ()
    ) -> list[str]:
        return [
            "attribute",
            *inputs,
            "--model",
            f"{self.module}:{model}",
            "--method",
            "gradient",
            "--out",
            str(self.root / "out"),
            *extra,
        ]

    def evaluate(self, *extra: str) -> list[str]:
        return [
            "evaluate",
            "--model",
            f"{self.module}:build",
            "--dataset",
            "digits",
            "--limit",
            "4",
            *extra,
        ]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    return Project(tmp_path, write_user_module(tmp_path, monkeypatch, "badcli", MODELS))


def one_line(err: str, code: int, expected_code: int = 1) -> str:
    assert code == expected_code, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("inputs", "phrase"),
    [
        (["x3.npy"], "cannot run on inputs of shape (1, 3, 8, 8)"),
        (["x10.npy"], "cannot run on inputs of shape (1, 1, 10, 10)"),
        (["x64.npy"], "cannot run on inputs of shape (1, 64)"),
        (["rgb.png"], "--channels"),
        (["empty.npy"], "inputs are empty"),
    ],
)
def test_attribute_inputs_the_model_cannot_take(project, capsys, inputs, phrase) -> None:
    code, out, err = run_cli(project.attribute(*inputs), capsys)
    line = one_line(err, code)
    assert line.startswith("explain: error:") and phrase in line, line
    assert out == "" and not (project.root / "out").exists()


def test_attribute_model_returning_a_tuple(project, capsys) -> None:
    code, _, err = run_cli(project.attribute("x.npy", model="pair"), capsys)
    line = one_line(err, code)
    assert "one tensor of scores" in line and "tuple" in line


def test_attribute_nan_weights_are_named(project, capsys) -> None:
    argv = project.attribute("x.npy", extra=("--weights", "nan.safetensors"))
    code, _, err = run_cli(argv, capsys)
    line = one_line(err, code)
    assert "NaN or infinite" in line and "nan.safetensors" in line and "'0.weight'" in line


def test_export_input_shape_the_model_cannot_take(project, capsys) -> None:
    argv = ["export", "--model", f"{project.module}:build", "--out", "m.onnx"]
    code, _, err = run_cli([*argv, "--input-shape", "3,8,8"], capsys)
    line = one_line(err, code)
    assert "cannot run on inputs of shape (4, 3, 8, 8)" in line and "--input-shape" in line
    assert not (project.root / "m.onnx").exists()


@pytest.mark.parametrize("value", ["2", "0", "-0.5", "nan", "half"])
def test_evaluate_fraction_is_checked_when_parsing(project, capsys, value) -> None:
    argv = project.evaluate("--job", "pixel-removal", "--method", "gradient", "--out", "ev")
    code, _, err = run_cli([*argv, "--fraction", value], capsys)
    line = one_line(err, code, expected_code=2)
    assert "--fraction" in line and "(0, 1]" in line


@pytest.mark.parametrize(
    ("device", "phrase"),
    [("meta", "cannot run the computation"), ("bogus", "expected cpu, cuda or cuda:N")],
)
def test_evaluate_device_is_checked_when_parsing(project, capsys, device, phrase) -> None:
    argv = project.evaluate("--job", "attributions", "--method", "gradient", "--out", "ev")
    code, _, err = run_cli([*argv, "--device", device], capsys)
    line = one_line(err, code, expected_code=2)
    assert "--device" in line and phrase in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_evaluate_absent_cuda_is_a_usage_error(project, capsys) -> None:
    argv = project.evaluate("--job", "attributions", "--method", "gradient", "--out", "ev")
    code, _, err = run_cli([*argv, "--device", "cuda"], capsys)
    assert "CUDA is not available" in one_line(err, code, expected_code=2)


def test_evaluate_rem_dictionary_needs_a_capsule_network(project, capsys) -> None:
    code, _, err = run_cli(project.evaluate("--job", "rem-dictionary", "--out", "ev"), capsys)
    line = one_line(err, code)
    assert "needs a capsule network" in line and "Sequential" in line
    assert not (project.root / "ev").exists()


def test_evaluate_image_size_the_model_cannot_take(project, capsys) -> None:
    argv = project.evaluate("--job", "attributions", "--method", "gradient", "--out", "ev")
    code, _, err = run_cli([*argv, "--image-size", "16"], capsys)
    line = one_line(err, code)
    assert "cannot run on inputs of shape (2, 1, 16, 16)" in line and "--image-size" in line


@pytest.mark.parametrize("command", ["attribute", "check", "export", "evaluate", "parse-tree"])
def test_output_under_a_file_names_the_path(project, capsys, command) -> None:
    if command == "parse-tree":
        pytest.importorskip("networkx")
    model = ["--model", f"{project.module}:build"]
    name = "result.svg" if command == "parse-tree" else "result.out"  # a picture's suffix
    out = ["--out", f"afile/sub/{name}"]
    argv = {
        "attribute": ["attribute", "x.npy", *model, "--method", "gradient", *out],
        "check": ["check", "x.npy", *model, "--method", "gradient", *out],
        "export": ["export", *model, "--input-shape", "1,8,8", *out],
        "evaluate": project.evaluate("--job", "attributions", "--method", "gradient", *out),
        "parse-tree": ["parse-tree", *model, "--class", "0", *out],
    }[command]
    code, _, err = run_cli(argv, capsys)
    line = one_line(err, code)
    assert "afile is a file, not a folder" in line, line
    assert "afile/sub" in line and f".{name}-" not in line
    assert project.afile.read_text() == "a regular file"


def _overwriting_cases(project: Project) -> dict[str, tuple[list[str], Path]]:
    """Command lines whose output would be one of their inputs, and that input."""
    root = project.root
    state = importlib.import_module(project.module).build().state_dict()
    save_file(state, root / "model.safetensors")
    Image.fromarray((np.random.rand(8, 8) * 255).astype(np.uint8)).save(root / "digit.png")
    (root / "results").mkdir()
    save_file(state, root / "results" / "csc.safetensors")
    weights = ["--model", f"{project.module}:build", "--weights", "model.safetensors"]
    gradient = ["--method", "gradient"]
    return {
        "attribute into the inputs' folder": (
            ["attribute", str(root / "x.npy"), *weights, *gradient, "--out", str(root)],
            root / "x.npy",
        ),
        "attribute next to an image": (
            ["attribute", "digit.png", *weights, *gradient, "--out", "."],
            root / "digit.png",
        ),
        "check onto its input": (
            ["check", "x.npy", *weights, *gradient, "--out", "x.npy"],
            root / "x.npy",
        ),
        "export onto the weights": (
            ["export", *weights, "--input-shape", "1,8,8", "--out", "model.safetensors"],
            root / "model.safetensors",
        ),
        "export onto a sample": (
            ["export", *weights, "--inputs", "x.npy", "--out", "./x.npy"],
            root / "x.npy",
        ),
        "parse-tree onto its input": (
            ["parse-tree", *weights, "--input", "digit.png", "--out", "digit.png"],
            root / "digit.png",
        ),
        "evaluate onto the weights": (
            [
                *project.evaluate("--job", "csc", "--method", "gradient", "--out", "results"),
                *("--weights", "results/csc.safetensors"),
            ],
            root / "results" / "csc.safetensors",
        ),
    }


OVERWRITING = (
    "attribute into the inputs' folder",
    "attribute next to an image",
    "check onto its input",
    "export onto the weights",
    "export onto a sample",
    "parse-tree onto its input",
    "evaluate onto the weights",
)


@pytest.mark.parametrize("case", OVERWRITING)
def test_outputs_never_overwrite_inputs(project, capsys, case) -> None:
    if case.startswith("export"):
        pytest.importorskip("onnxruntime")
    if case.startswith("parse-tree"):
        pytest.importorskip("networkx")
    argv, victim = _overwriting_cases(project)[case]
    before = {p: p.read_bytes() for p in project.root.rglob("*") if p.is_file()}
    code, out, err = run_cli(argv, capsys)
    line = one_line(err, code)
    assert "refusing to write" in line and f"{victim.name}, which would be overwritten" in line
    assert "choose another --out" in line and out == ""
    after = {p: p.read_bytes() for p in project.root.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing changed


def test_an_output_linked_to_an_input_is_refused(project, capsys) -> None:
    os.link(project.root / "x.npy", project.root / "linked.npy")  # the same file, two names
    argv = ["check", "x.npy", "--model", f"{project.module}:build", "--method", "gradient"]
    code, _, err = run_cli([*argv, "--out", "linked.npy"], capsys)
    assert "refusing to write linked.npy: it is the input file x.npy" in one_line(err, code)


@pytest.mark.parametrize(
    "command", ["attribute", "check", "export", "evaluate", "parse-tree", "demo"]
)
def test_empty_out_is_a_usage_error(project, capsys, command) -> None:
    model = ["--model", f"{project.module}:build"]
    argv = {
        "demo": ["demo", "--quick"],
        "attribute": ["attribute", "x.npy", *model, "--method", "gradient"],
        "check": ["check", "x.npy", *model, "--method", "gradient"],
        "export": ["export", *model, "--input-shape", "1,8,8"],
        "evaluate": project.evaluate("--job", "attributions", "--method", "gradient"),
        "parse-tree": ["parse-tree", *model, "--class", "0"],
    }[command]
    before = sorted(project.root.iterdir())
    code, _, err = run_cli([*argv, "--out", ""], capsys)
    line = one_line(err, code, expected_code=2)
    assert "--out: expected a file or folder name; got an empty path" in line
    assert sorted(project.root.iterdir()) == before


def test_any_explain_error_is_one_line_but_bugs_keep_their_traceback(
    project, capsys, monkeypatch
) -> None:
    def user_error(args):
        raise InvalidInputError("got X\nexpected Y; do Z")

    monkeypatch.setattr(attribute_command, "run", user_error)
    code, _, err = run_cli(project.attribute("x.npy"), capsys)
    assert one_line(err, code) == "explain: error: got X expected Y; do Z"

    def os_error(args):
        raise FileNotFoundError(2, "No such file or directory", "gone.npy")

    monkeypatch.setattr(attribute_command, "run", os_error)
    code, _, err = run_cli(project.attribute("x.npy"), capsys)
    line = one_line(err, code)
    assert "gone.npy" in line and "No such file or directory" in line

    def bug(args):
        raise RuntimeError("a programming error")

    monkeypatch.setattr(attribute_command, "run", bug)
    with pytest.raises(RuntimeError, match="a programming error"):
        main(project.attribute("x.npy"))
