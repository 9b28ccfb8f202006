"""``explain check``: the faithfulness card of one method on one model, and bad input."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, write_user_module
from safetensors.torch import save_file

pytestmark = pytest.mark.usefixtures("restore_showwarning")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A user's model module, its weights and two 8×8 inputs, in the working folder."""
    module = write_user_module(
        tmp_path,
        monkeypatch,
        "checkmodels",
        "from torch import nn\n\n\n"
        "def build():\n"
        "    return nn.Sequential(\n"
        "        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10)\n"
        "    )\n",
    )
    torch.manual_seed(3)
    model = importlib.import_module(module).build()
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        np.save(tmp_path / f"{name}.npy", rng.uniform(0, 1, (1, 8, 8)).astype(np.float32))
    np.save(tmp_path / "small.npy", np.zeros((1, 4, 4), dtype=np.float32))
    (tmp_path / "afile").write_text("a file, not a folder")
    return {"model": f"{module}:build", "weights": "w.safetensors"}


def _base(project: dict[str, str], method: str = "lrp.epsilon") -> list[str]:
    model = ["--model", project["model"], "--weights", project["weights"]]
    return ["check", *model, "--method", method, "--vectors", "2"]


def test_card_on_bundled_digits(project, capsys) -> None:
    argv = [*_base(project), "--dataset", "digits", "--samples", "8", "--out", "cards/c.json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "faithfulness card: lrp.epsilon on 8 samples (first layer: 0)" in out
    for label in ("completeness error", "CSC at the first layer", "random-logit SSIM"):
        assert label in out
    assert "SSIM, all layers randomised" in out and "wrote cards/c.json" in out
    card = json.loads(Path("cards/c.json").read_text())
    assert card["method"] == "lrp.epsilon" and card["samples"] == 8
    assert card["data"] == "digits" and card["randomised_layers"] == ["3", "0"]
    assert card["completeness"] >= 0  # random weights with biases: far from complete
    assert 0 <= card["csc_first_layer"] <= 1
    for key in ("random_logit_ssim", "randomisation_ssim_top", "randomisation_ssim_all"):
        assert -1 <= card[key] <= 1
    assert [p.name for p in Path("cards").iterdir()] == ["c.json"]  # no temporary left


def test_card_on_files_with_target_and_undefined_entries(project, capsys) -> None:
    argv = [*_base(project, "integrated_gradients"), "a.npy", "b.npy", "--target", "3"]
    code, out, err = run_cli([*argv, "--option", "steps=8"], capsys)
    assert code == 0, err
    assert "not supported by the method" in out  # no CSC for integrated gradients
    assert "on 2 samples" in out
    code, out, err = run_cli([*_base(project, "gradient"), "a.npy"], capsys)
    assert code == 0, err
    assert "not defined" in out  # the gradient has no completeness delta


FAILURES = {
    "unknown method": (["--method", "lrp.epsilonn", "a.npy"], ("lrp.epsilonn", "'lrp.epsilon'")),
    "missing input": (["missing.npy"], ("missing.npy", "does not exist")),
    "wrong shape": (["small.npy"], ("cannot run on inputs of shape (1, 1, 4, 4)",)),
    "mixed shapes": (["a.npy", "small.npy"], ("one shape",)),
    "missing weights": (["a.npy", "--weights", "nope.safetensors"], ("nope.safetensors",)),
    "no data": ([], ("--dataset digits",)),
    "files and dataset": (["a.npy", "--dataset", "digits"], ("not both",)),
    "unwritable out": (["a.npy", "--out", "afile/card.json"], ("afile",)),
    "out is a folder": (["a.npy", "--out", "."], ("is a folder",)),
    "target out of range": (["a.npy", "--target", "12"], ("target 12", "[0, 9]")),
    "too few vectors": (["a.npy", "--vectors", "1"], ("--vectors",)),
    "bad option": (["a.npy", "--option", "nonsense=1"], ("nonsense",)),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_bad_input_is_one_line_and_writes_nothing(case: str, project, capsys) -> None:
    extra, keywords = FAILURES[case]
    before = sorted(p.name for p in Path.cwd().iterdir())
    code, out, err = run_cli([*_base(project), *extra], capsys)
    assert code == 1, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("explain: error:"), err
    for keyword in keywords:
        assert keyword in lines[0], (keyword, lines[0])
    after = sorted(p.name for p in Path.cwd().iterdir() if p.name != "__pycache__")
    assert after == [name for name in before if name != "__pycache__"]


def test_help_lists_the_options(capsys) -> None:
    code, out, _ = run_cli(["check", "--help"], capsys)
    assert code == 0
    for option in ("--model", "--weights", "--method", "--dataset", "--out", "--option"):
        assert option in out


def test_resize_and_normalize_prepare_the_inputs_as_for_attribute(project, capsys) -> None:
    """The card of ``--normalize`` equals the card of inputs normalised beforehand."""
    a = np.load("a.npy")
    np.save("a_normalised.npy", (a - 0.5) / 0.25)
    argv = [*_base(project, "gradient"), "--target", "3", "--seed", "1"]
    code, _, err = run_cli([*argv, "a.npy", "--normalize", "0.5,0.25", "--out", "n.json"], capsys)
    assert code == 0, err
    code, _, err = run_cli([*argv, "a_normalised.npy", "--out", "by_hand.json"], capsys)
    assert code == 0, err
    card, by_hand = (
        json.loads(Path("n.json").read_text()),
        json.loads(Path("by_hand.json").read_text()),
    )
    for key in ("csc_first_layer", "random_logit_ssim", "randomisation_ssim_all"):
        assert card[key] == pytest.approx(by_hand[key], abs=1e-6), key
    # A 4×4 input the 8×8 model cannot take runs once resized.
    code, out, err = run_cli([*_base(project), "small.npy", "--resize", "8,8"], capsys)
    assert code == 0, err
    assert "on 1 samples" in out
