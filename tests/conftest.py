"""Fixtures and helpers shared by the tests (import the helpers with ``from conftest import``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def quick_demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One ``explain demo --quick`` run of the console script (with its own model cache).

    Shared by every test that reads a demo's output (tests/test_demo.py, tests/test_cli.py):
    the report folder and the script's stdout. Tests read the folder; they copy it to change it.
    """
    root = tmp_path_factory.mktemp("demo")
    out = root / "report"
    explain = Path(sys.executable).parent / "explain"
    result = subprocess.run(
        [str(explain), "demo", "--quick", "--out", str(out), "--cache", str(root / "cache")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert result.returncode == 0, result.stderr
    return out, result.stdout


@pytest.fixture
def restore_showwarning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo the one-line warning printer that the CLI's ``main()`` installs, after the test."""
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run the whole test module with one torch thread, then restore the previous count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``explain argv`` in this process: exit status (usage errors too), stdout, stderr."""
    from explain_core.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def write_user_module(
    folder: Path, monkeypatch: pytest.MonkeyPatch, prefix: str, source: str
) -> str:
    """Write ``source`` as a uniquely named module in ``folder``, a user's model module.

    ``folder`` becomes the working directory and importable for the test.

    Returns:
        The module's name (``prefix`` and a random suffix).
    """
    name = f"{prefix}_{uuid.uuid4().hex}"
    (folder / f"{name}.py").write_text(source)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    importlib.invalidate_caches()
    return name


def state_fingerprint(model: torch.nn.Module) -> dict:
    """Everything attribution must leave unchanged, in comparable form."""
    hook_names = [
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
    ]
    return {
        "state": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
        "param_ids": {k: id(v) for k, v in model.named_parameters()},
        "buffer_ids": {k: id(v) for k, v in model.named_buffers()},
        "module_ids": {k: id(m) for k, m in model.named_modules()},
        "hooks": {
            k: [len(getattr(m, h, {})) for h in hook_names] for k, m in model.named_modules()
        },
        "attrs": {k: sorted(m.__dict__) for k, m in model.named_modules()},
        "training": {k: m.training for k, m in model.named_modules()},
        "requires_grad": {k: v.requires_grad for k, v in model.named_parameters()},
    }


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key == "state":
            assert before[key].keys() == after[key].keys()
            for name in before[key]:
                assert torch.equal(before[key][name], after[key][name]), name
        else:
            assert before[key] == after[key], key
