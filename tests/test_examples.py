"""Smoke tests: the examples run as a user would run them, briefly."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_resnet_lrp_example(tmp_path: Path) -> None:
    result = _run("resnet_lrp.py", "--out", "out", "--epochs", "1", cwd=tmp_path)
    assert "model unchanged" in result.stdout
    for name in ("LRP ε+z⁺", "DeepLIFT Rescale"):
        assert name in result.stdout
    deeplift = next(line for line in result.stdout.splitlines() if "DeepLIFT" in line)
    assert float(deeplift.rsplit(" ", 1)[1]) < 1e-4  # DeepLIFT is complete, BatchNorm and all
    assert (tmp_path / "out" / "resnet_lrp.png").stat().st_size > 1000


def test_parse_trees_example(tmp_path: Path) -> None:
    pytest.importorskip("networkx")
    result = _run("parse_trees.py", "--out", "trees", "--epochs", "1", cwd=tmp_path)
    assert "L1:" in result.stdout  # the text tree reaches the primary capsules
    names = {p.name for p in (tmp_path / "trees").iterdir()}
    for stem in ("sample-0", "dataset"):
        assert {f"{stem}.graphml", f"{stem}.txt", f"{stem}.gv"} <= names
    if shutil.which("dot"):  # pictures need graphviz's dot program
        assert {"sample-0.svg", "dataset.svg"} <= names
