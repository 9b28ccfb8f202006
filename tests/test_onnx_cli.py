"""``explain export`` end to end, and the example that runs an exported graph without torch."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, write_user_module
from safetensors.torch import save_file

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason="the onnx extra is not installed")

from explain_coda import CoDANet, coda_contributions, encode_input  # noqa: E402
from explain_core.data import load_digits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXPORT_SCRIPT = ROOT / "examples" / "onnx_coda_export" / "export_coda.py"
RUN_WITHOUT_TORCH = EXPORT_SCRIPT.with_name("run_onnxruntime.py")


pytestmark = pytest.mark.usefixtures("restore_showwarning", "one_torch_thread")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user package with a CoDA-Net factory and trained-looking weights, as cwd."""
    name = write_user_module(
        tmp_path,
        monkeypatch,
        "onnx_models",
        "from explain_coda import CoDANet\n\n"
        "def build():\n    return CoDANet.from_preset('digits', temperature=8.0)\n",
    )
    torch.manual_seed(0)
    model = CoDANet.from_preset("digits", temperature=8.0)
    save_file(model.state_dict(), tmp_path / "coda.safetensors")
    yield tmp_path, name, model.eval()
    sys.modules.pop(name, None)


def test_help(capsys):
    code, out, err = run_cli(["export", "--help"], capsys)
    assert code == 0 and out.startswith("usage: explain export") and err == ""
    for option in ("--model", "--weights", "--out", "--explain", "--opset", "--target-input"):
        assert option in out


def test_export_explained_coda_end_to_end(project, capsys):
    folder, name, model = project
    digits = encode_input(load_digits().test_images[:3])
    for i, sample in enumerate(digits):
        np.save(folder / f"digit{i}.npy", sample.numpy())
    code, out, err = run_cli(
        ["export", "--model", f"{name}:build", "--weights", "coda.safetensors",
         "--out", "out/coda.onnx", "--explain", "coda.contributions",
         "--inputs", "digit0.npy", "digit1.npy", "digit2.npy"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert err == ""
    assert "(input) -> (logits, explanation)" in out
    assert "parity ok: logits max abs diff" in out and "explanation max rel diff" in out
    assert "random, real" in out
    assert "provider: CPUExecutionProvider" in out or "provider: CUDAExecutionProvider" in out

    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "out" / "coda.onnx"))
    logits, contributions = session.run(None, {"input": digits.numpy()})
    reference = coda_contributions(model, digits)
    assert np.abs(logits - reference.output.numpy()).max() <= 1e-4
    assert np.abs(contributions - reference.contributions.numpy()).max() <= 1e-3 * float(
        reference.contributions.abs().max()
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--explain", "lrp.contrastive"], "method 'lrp.contrastive' cannot be exported"),
        (
            ["--explain", "lrp.epsilonplus"],
            "unknown method 'lrp.epsilonplus'; did you mean 'lrp.epsilon_plus'",
        ),
        (["--option", "levels=3"], "--option and --target-input need --explain"),
        (["--opset", "3"], "--opset must be an int from 15 to"),
        (["--opset", "14"], "below 15, onnx cannot convert torch.onnx's opset-18 graphs"),
        (["--out", "."], "is a folder"),
    ],
)
def test_failures_are_one_line(project, capsys, extra, message):
    folder, name, _ = project
    argv = ["export", "--model", f"{name}:build", "--weights", "coda.safetensors"]
    argv += extra if "--out" in extra else ["--out", "m.onnx", *extra]
    code, _, err = run_cli(argv, capsys)
    assert code == 1
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("explain: error:"), err
    assert message in lines[0]
    assert not (folder / "m.onnx").exists()


def test_opsets_onnxruntime_cannot_load_are_refused_before_exporting(project, capsys):
    import onnx
    import onnxruntime as ort

    from explain_onnx.export import newest_runtime_opset

    known = int(onnx.defs.onnx_opset_version())
    loadable = newest_runtime_opset()
    newest = min(known, loadable)
    folder, _, _ = project
    argv = ["export", "--model", "no_such_module:build", "--out", "m.onnx"]  # never loaded
    code, _, err = run_cli([*argv, "--opset", str(newest + 1)], capsys)
    assert code == 1 and len(err.splitlines()) == 1
    # The limit is onnxruntime's when it loads fewer opsets than onnx knows, else onnx's.
    if loadable < known:
        assert f"{newest} is the newest onnxruntime {ort.__version__} loads" in err
    else:
        assert f"{newest} is the newest the installed onnx knows" in err
    assert f"got {newest + 1}" in err and not (folder / "m.onnx").exists()


def test_unknown_input_shape_is_explained(tmp_path, monkeypatch, capsys):
    name = write_user_module(
        tmp_path,
        monkeypatch,
        "onnx_plain",
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Flatten(), "
        "torch.nn.Linear(4, 2))\n",
    )
    code, _, err = run_cli(["export", "--model", f"{name}:build", "--out", "m.onnx"], capsys)
    assert code == 1 and "give --input-shape C,H,W" in err
    code, out, err = run_cli(
        ["export", "--model", f"{name}:build", "--out", "m.onnx", "--input-shape", "1,2,2"],
        capsys,
    )
    assert code == 0, err
    assert "(example, random; sizes 1, 3)" in out


def test_example_runs_with_onnxruntime_alone(tmp_path):
    spec = importlib.util.spec_from_file_location("onnx_export_coda_example", EXPORT_SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    numbers = example.main(tmp_path / "demo", epochs=1, threads=None)  # a brief training
    assert numbers["accuracy"] > 0.5

    code = (
        "import runpy, sys\n"
        f"sys.argv = ['run_onnxruntime.py', {str(tmp_path / 'demo')!r}]\n"
        f"runpy.run_path({str(RUN_WITHOUT_TORCH)!r}, run_name='__main__')\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # onnxruntime's CastLike constant-folding warnings are silenced
    assert result.stdout.strip().endswith("torch imported: False")
    numbers = dict(
        line.split(": ", 1) for line in result.stdout.splitlines() if line.count(": ") == 1
    )
    assert float(numbers["logits_max_abs_diff"]) <= 1e-4
    assert float(numbers["contributions_max_rel_diff"]) <= 1e-3
    assert float(numbers["completeness_max_abs_error"]) <= 1e-4


def test_example_readme_gives_the_commands():
    readme = (EXPORT_SCRIPT.parent / "README.md").read_text()
    commands = re.findall(r"^\.venv/bin/python (\S+) (\S+)", readme, re.MULTILINE)
    assert commands == [
        ("examples/onnx_coda_export/export_coda.py", "--out"),
        ("examples/onnx_coda_export/run_onnxruntime.py", "onnx-demo"),
    ]
    assert all((ROOT / script).is_file() for script, _ in commands)
