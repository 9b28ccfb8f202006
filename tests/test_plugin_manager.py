"""Plugin discovery, the autoload switch and isolation of broken plugins.

The discovery tests install real distributions (the example in ``examples/third_party_plugin``
and a deliberately broken one) into temporary folders with pip and run the CLI in subprocesses
with those folders on ``PYTHONPATH``, so entry points are found exactly as for a user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from explain_core import DuplicateMethodError, MethodSpec, UnknownMethodError, hookimpl
from explain_core.plugin_manager import ENV_VARIABLE, PluginManager, PluginWarning
from explain_gradients.methods import Gradient

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "third_party_plugin"
GRADIENT_METHODS = [
    "dynamic.contributions",
    "gradient",
    "input_x_gradient",
    "integrated_gradients",
    "smoothgrad",
]


# --- helpers -------------------------------------------------------------------------------------


def _pip_install(source: Path, target: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        str(target),
        str(source),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"pip install {source} failed:\n{done.stdout}\n{done.stderr}"


def _run(
    args: list[str], paths: list[Path], plugins: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python <args>`` with ``paths`` prepended to PYTHONPATH and EXPLAIN_PLUGINS set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in paths] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.pop(ENV_VARIABLE, None)
    if plugins is not None:
        env[ENV_VARIABLE] = plugins
    # Run outside the checkout so that the installed packages are used, as for a user.
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=paths[0].parent,
    )


def _plugins_cli(paths: list[Path], plugins: str | None = None) -> subprocess.CompletedProcess[str]:
    return _run(["-m", "explain_core", "plugins"], paths, plugins)


def _plugin_line(stdout: str, name: str) -> str | None:
    """The header line ``<name> <version> (<source>) - ...`` of one plugin, if listed."""
    return next((line for line in stdout.splitlines() if line.startswith(f"{name} ")), None)


@pytest.fixture(scope="session")
def sign_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``examples/third_party_plugin`` built and installed into its own folder."""
    # Build from a copy so that setuptools' build/ and *.egg-info never land in the checkout.
    source = tmp_path_factory.mktemp("sign-source") / "third_party_plugin"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp_path_factory.mktemp("sign-site")
    _pip_install(source, target)
    return target


@pytest.fixture(scope="session")
def broken_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distribution whose plugin module raises ``ImportError("boom")`` on import."""
    source = tmp_path_factory.mktemp("broken-source")
    (source / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "explain-broken-plugin"
            version = "9.9.9"

            [project.entry-points."explain.plugins"]
            broken = "explain_broken_plugin"

            [tool.setuptools]
            packages = ["explain_broken_plugin"]
            """
        )
    )
    (source / "explain_broken_plugin").mkdir()
    (source / "explain_broken_plugin" / "__init__.py").write_text('raise ImportError("boom")\n')
    target = tmp_path_factory.mktemp("broken-site")
    _pip_install(source, target)
    return target


# --- a real third-party distribution -------------------------------------------------------------


def test_installed_example_is_listed(sign_target: Path) -> None:
    assert (sign_target / "explain_sign_plugin-0.3.0.dist-info").is_dir()
    done = _plugins_cli([sign_target])
    assert done.returncode == 0, done.stderr
    assert _plugin_line(done.stdout, "sign") == (
        "sign 0.3.0 (entry point of explain-sign-plugin) - 1 method"
    )
    assert "    commands: sign-count" in done.stdout
    assert "    jobs: sign-balance" in done.stdout
    assert "    export forms: sign.gradient_sign" in done.stdout
    assert "sign.gradient_sign" in done.stdout
    assert "[gradient] Sign of the gradient of the target output" in done.stdout
    # The built-in plugin is still there next to it.
    assert _plugin_line(done.stdout, "explain_gradients") is not None
    assert "integrated_gradients" in done.stdout
    assert "warning" not in done.stderr


TINY_MODEL = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10)
    ).eval()
"""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-model")
    (folder / "tinymodel.py").write_text(TINY_MODEL)
    return folder


def test_a_third_party_command_job_and_export_form_work_end_to_end(
    sign_target: Path, tiny_model: Path, tmp_path: Path
) -> None:
    # The installed example adds a subcommand, an evaluation job and an explained-export form
    # through the same hooks as the built-ins; each runs as a user would run it.
    paths = [sign_target, tiny_model]
    model = ["--model", "tinymodel:build"]
    done = _run(["-m", "explain_core", "sign-count", *model, "--input-shape", "1,8,8"], paths)
    assert done.returncode == 0, done.stderr
    up, down, zero = (int(n) for n in done.stdout.split()[1::2])
    assert up + down + zero == 4 * 64 and up > 0 and down > 0

    out = tmp_path / "balance"
    evaluate = ["evaluate", *model, "--dataset", "digits", "--limit", "8", "--job"]
    done = _run(
        ["-m", "explain_core", *evaluate, "sign-balance", "--method", "sign.gradient_sign",
         "--above", "0", "--out", str(out)],
        paths,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "sign-balance.json").read_text())["summary"]
    assert 0.0 < summary["mean_fraction"] < 1.0

    pytest.importorskip("onnxruntime")
    onnx_file = tmp_path / "sign.onnx"
    done = _run(
        ["-m", "explain_core", "export", *model, "--out", str(onnx_file),
         "--explain", "sign.gradient_sign", "--input-shape", "1,8,8"],
        paths,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "parity" in done.stdout.lower() and onnx_file.is_file()
    # The graph's maps are signs, and equal the method's on the same inputs.
    import onnxruntime

    session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(5))
    logits, signs = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert set(np.unique(signs)) <= {-1.0, 0.0, 1.0}
    namespace: dict = {}
    exec(TINY_MODEL, namespace)
    net = namespace["build"]()
    x = x.requires_grad_(True)
    output = net(x)
    (gradient,) = torch.autograd.grad(output.gather(1, output.argmax(1, keepdim=True)).sum(), x)
    assert np.array_equal(signs, gradient.sign().detach().numpy())
    assert np.allclose(logits, output.detach().numpy(), atol=1e-5)


def test_installed_example_computes_gradient_sign(sign_target: Path) -> None:
    script = textwrap.dedent(
        """\
        import torch
        from explain_core import explain

        model = torch.nn.Linear(3, 4).eval()
        with torch.no_grad():
            model.weight.copy_(torch.tensor([
                [0.5, -2.0, 0.0],
                [-0.3, 0.7, 1.5],
                [2.5, 0.0, -0.1],
                [-1.0, -1.0, 3.0],
            ]))
            model.bias.zero_()
        x = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.25]])

        result = explain(model, x, "sign.gradient_sign", target=[0, 2])
        # For a Linear model, d output[t] / d x is the weight row t.
        expected = torch.sign(model.weight.detach()[[0, 2]])
        assert torch.equal(result.attribution, expected), result.attribution
        assert result.target.tolist() == [0, 2], result.target
        assert torch.allclose(result.output, model(x).detach())
        assert result.method == "sign.gradient_sign"

        # No target: the predicted class of each sample.
        predicted = model(x).argmax(dim=1)
        result = explain(model, x, "sign.gradient_sign")
        assert torch.equal(result.target, predicted), result.target
        assert torch.equal(result.attribution, torch.sign(model.weight.detach()[predicted]))
        print("sign plugin OK")
        """
    )
    done = _run(["-c", script], [sign_target])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "sign plugin OK"


# --- EXPLAIN_PLUGINS ------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["", "none"])
def test_autoload_off_loads_only_builtins(sign_target: Path, setting: str) -> None:
    done = _plugins_cli([sign_target], setting)
    assert done.returncode == 0, done.stderr
    assert _plugin_line(done.stdout, "sign") is None
    assert "sign.gradient_sign" not in done.stdout
    assert _plugin_line(done.stdout, "explain_gradients").endswith("(built-in) - 5 methods")
    assert "input_x_gradient" in done.stdout
    assert "warning" not in done.stderr


def test_autoload_selected_name(sign_target: Path) -> None:
    done = _plugins_cli([sign_target], "sign")
    assert done.returncode == 0, done.stderr
    assert _plugin_line(done.stdout, "sign") is not None
    assert "sign.gradient_sign" in done.stdout
    assert _plugin_line(done.stdout, "explain_gradients") is not None


def test_autoload_unknown_name_warns(sign_target: Path) -> None:
    done = _plugins_cli([sign_target], "other")
    assert done.returncode == 0, done.stderr
    assert _plugin_line(done.stdout, "sign") is None
    assert "sign.gradient_sign" not in done.stdout
    assert _plugin_line(done.stdout, "explain_gradients") is not None
    warning_lines = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warning_lines) == 1, done.stderr
    assert warning_lines[0].startswith("explain: warning:")
    assert "other" in warning_lines[0] and ENV_VARIABLE in warning_lines[0]


# --- a broken third-party distribution -----------------------------------------------------------


def test_broken_plugin_does_not_break_help(sign_target: Path, broken_target: Path) -> None:
    done = _run(["-m", "explain_core", "--help"], [sign_target, broken_target])
    assert done.returncode == 0, done.stderr
    assert "plugins" in done.stdout
    assert "Traceback" not in done.stderr


def test_broken_plugin_is_isolated(sign_target: Path, broken_target: Path) -> None:
    done = _plugins_cli([sign_target, broken_target])
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    # The others keep working.
    assert _plugin_line(done.stdout, "explain_gradients") is not None
    assert "integrated_gradients" in done.stdout
    assert _plugin_line(done.stdout, "sign") is not None
    assert "sign.gradient_sign" in done.stdout
    # The broken one is listed with its reason.
    broken = _plugin_line(done.stdout, "broken")
    assert broken is not None, done.stdout
    assert broken.startswith("broken 9.9.9 (entry point of explain-broken-plugin)")
    assert "FAILED" in broken and "ImportError" in broken and "boom" in broken
    # One warning line on stderr naming it.
    stderr_lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(stderr_lines) == 1, done.stderr
    assert stderr_lines[0].startswith("explain: warning:")
    assert "'broken'" in stderr_lines[0] and "boom" in stderr_lines[0]


def test_broken_plugin_can_be_switched_off(sign_target: Path, broken_target: Path) -> None:
    done = _plugins_cli([sign_target, broken_target], "sign")
    assert done.returncode == 0, done.stderr
    assert _plugin_line(done.stdout, "broken") is None
    assert _plugin_line(done.stdout, "sign") is not None
    assert done.stderr == ""


# --- in-process: PluginManager -------------------------------------------------------------------


class _Plugin:
    """A plugin object registering the given methods (all as ``Gradient``)."""

    def __init__(self, *names: str) -> None:
        self.names = names

    @hookimpl
    def explain_register_methods(self) -> list[MethodSpec]:
        return [MethodSpec(name, Gradient, "test", f"test method {name}") for name in self.names]


def _builtin_manager() -> PluginManager:
    # Only the gradient built-in, so the expected method lists stay independent of other plugins.
    manager = PluginManager()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        manager.load(builtins=("explain_gradients",), entry_points=False)
    return manager


def test_all_builtins_load_cleanly() -> None:
    manager = PluginManager()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        manager.load(entry_points=False)
    assert set(manager.plugins) == {
        "explain_core",
        "explain_gradients",
        "explain_coda",
        "explain_capsules",
        "explain_modbp",
        "explain_onnx",
    }
    assert "coda.contributions" in manager.registry
    assert {"export", "parse-tree", "evaluate"} <= set(manager.commands())
    assert {"csc", "rem-dictionary"} <= set(manager.jobs())
    assert "lrp.epsilon_plus" in manager.export_forms()
    assert manager.registry["lrp.epsilon_plus"].family == "modified-bp"


def test_builtin_gradient_plugin_registers_exactly_its_methods() -> None:
    manager = _builtin_manager()
    registry = manager.registry
    assert sorted(registry) == GRADIENT_METHODS
    assert [spec.name for spec in registry.by_plugin("explain_gradients")] == GRADIENT_METHODS
    info = manager.plugins["explain_gradients"]
    assert info.error is None
    assert info.source == "built-in"
    assert info.methods == GRADIENT_METHODS
    assert registry["gradient"].family == "gradient"
    assert registry["dynamic.contributions"].plugin == "explain_gradients"


def test_registered_plugin_adds_methods() -> None:
    manager = _builtin_manager()
    manager.register(_Plugin("extra.one", "extra.two"), "extra")
    assert [spec.name for spec in manager.registry.by_plugin("extra")] == ["extra.one", "extra.two"]
    assert manager.plugins["extra"].methods == ["extra.one", "extra.two"]
    assert len(manager.registry) == len(GRADIENT_METHODS) + 2


def test_a_third_party_name_clashing_with_a_builtin_leaves_the_builtin() -> None:
    manager = _builtin_manager()
    manager.register(_Plugin("copy.unique", "gradient"), "copycat")
    with pytest.warns(PluginWarning, match="'gradient' skipped.*'explain_gradients'"):
        registry = manager.registry
    assert registry["gradient"].plugin == "explain_gradients"
    assert registry["copy.unique"].plugin == "copycat"  # its other method still works
    assert manager.plugins["copycat"].methods == ["copy.unique"]
    assert any("'gradient' skipped" in p for p in manager.plugins["copycat"].problems)


def test_duplicate_between_two_third_party_plugins() -> None:
    manager = PluginManager()
    manager.register(_Plugin("shared.name"), "first")
    manager.register(_Plugin("shared.name"), "second")
    with pytest.raises(DuplicateMethodError) as raised:
        _ = manager.registry
    assert "'first'" in str(raised.value) and "'second'" in str(raised.value)


class _MisspelledHook:
    @hookimpl
    def explain_register_methods(self) -> list[MethodSpec]:
        return [MethodSpec("typo.method", Gradient, "test", "never registered")]

    @hookimpl
    def explain_register_methodz(self) -> list[MethodSpec]:
        return []


def test_misspelled_hook_name_fails_only_that_plugin() -> None:
    manager = _builtin_manager()
    with pytest.warns(PluginWarning, match=r"(?s)'typo'.*explain_register_methodz"):
        manager.register(_MisspelledHook(), "typo")
    assert "explain_register_methodz" in manager.plugins["typo"].error
    assert manager.pm.get_plugin("typo") is None
    manager.register(_Plugin("after.typo"), "later")  # the manager keeps working
    assert sorted(manager.registry) == sorted([*GRADIENT_METHODS, "after.typo"])
    assert manager.plugins["explain_gradients"].error is None
    assert manager.plugins["later"].error is None


class _UnknownArgument:
    @hookimpl
    def explain_register_methods(self, device: str) -> list[MethodSpec]:
        return [MethodSpec("badarg.method", Gradient, "test", "never registered")]


def test_hookimpl_with_unknown_argument_fails_only_that_plugin() -> None:
    manager = _builtin_manager()
    with pytest.warns(PluginWarning, match=r"(?s)'badarg'.*device"):
        manager.register(_UnknownArgument(), "badarg")
    assert "device" in manager.plugins["badarg"].error
    assert manager.pm.get_plugin("badarg") is None
    assert sorted(manager.registry) == GRADIENT_METHODS


class _RaisingHook:
    @hookimpl
    def explain_register_methods(self) -> list[MethodSpec]:
        raise RuntimeError("kaput")


def test_hook_raising_at_call_time_fails_only_that_plugin() -> None:
    manager = _builtin_manager()
    manager.register(_RaisingHook(), "raiser")
    manager.register(_Plugin("other.method"), "other")
    assert manager.plugins["raiser"].error is None  # registering works; calling fails
    with pytest.warns(PluginWarning, match=r"'raiser'.*RuntimeError: kaput"):
        registry = manager.registry
    assert "kaput" in manager.plugins["raiser"].error
    assert sorted(registry) == sorted([*GRADIENT_METHODS, "other.method"])
    assert registry["other.method"].plugin == "other"
    assert manager.plugins["raiser"].methods == []
    # A failed plugin stays failed: rebuilding the registry does not call it (or warn) again.
    manager.register(_Plugin("late.method"), "late")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        assert "late.method" in manager.registry
    assert "kaput" in manager.plugins["raiser"].error


def test_missing_builtin_module_fails_only_that_plugin() -> None:
    manager = PluginManager()
    with pytest.warns(PluginWarning, match=r"no built-in plugin is named 'explain_no_such_plugin'"):
        manager.load(builtins=("explain_no_such_plugin", "explain_gradients"), entry_points=False)
    assert "explain_no_such_plugin" in manager.plugins["explain_no_such_plugin"].error
    assert manager.plugins["explain_gradients"].error is None
    assert sorted(manager.registry) == GRADIENT_METHODS


def test_unknown_method_name_suggests_closest() -> None:
    registry = _builtin_manager().registry
    with pytest.raises(UnknownMethodError, match=r"did you mean 'gradient'") as raised:
        registry["gradiant"]
    assert isinstance(raised.value, KeyError)
    assert raised.value.suggestions[0] == "gradient"
    assert "gradiant" in str(raised.value)


def test_name_clash_fails_only_the_newcomer() -> None:
    manager = _builtin_manager()
    with pytest.warns(PluginWarning, match="explain_gradients"):
        manager.register(_Plugin("clash.method"), "explain_gradients")
    assert manager.plugins["explain_gradients"].error is None
    assert sorted(manager.registry) == GRADIENT_METHODS
