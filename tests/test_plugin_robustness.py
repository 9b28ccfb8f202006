"""Misbehaving third-party plugins are isolated, named and reported; the library keeps working.

Plugins are plugin objects registered in code, or real distributions: a ``*.dist-info`` folder
with ``entry_points.txt`` written into a temporary folder on ``sys.path``, which
``importlib.metadata`` finds exactly as it finds an installed one.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, write_user_module
from safetensors.torch import save_file
from test_plugin_manager import GRADIENT_METHODS
from torch import nn

import explain_core.plugin_manager as plugin_manager
from explain_core import (
    DuplicateMethodError,
    ExplainError,
    Method,
    MethodResult,
    MethodSpec,
    UnknownMethodError,
    explain,
    hookimpl,
)
from explain_core.cli.command import Command
from explain_core.demo import DemoSection, DemoStep
from explain_core.export_forms import ExportForm
from explain_core.plugin_manager import ENV_VARIABLE, PluginManager, PluginWarning
from explain_core.registry import MethodError
from explain_core.targets import select_target
from explain_gradients.methods import Gradient

pytestmark = pytest.mark.usefixtures("restore_showwarning")


# --- helpers ---------------------------------------------------------------------------------


class _Plugin:
    """A plugin object whose ``explain_register_methods`` returns ``items`` as given."""

    def __init__(self, items: object) -> None:
        self.items = items

    @hookimpl
    def explain_register_methods(self) -> object:
        return self.items


def _specs(*names: str) -> list[MethodSpec]:
    return [MethodSpec(name, Gradient, "test", f"test method {name}") for name in names]


def _manager(*plugins: tuple[str, object], builtins_first: bool = True) -> PluginManager:
    """The gradient built-in and ``plugins`` (name, object), registered in code."""
    manager = PluginManager()
    if builtins_first:
        manager.load(builtins=("explain_gradients",), entry_points=False)
    for name, plugin in plugins:
        manager.register(plugin, name)
    if not builtins_first:
        manager.load(builtins=("explain_gradients",), entry_points=False)
    return manager


@pytest.fixture
def use(monkeypatch: pytest.MonkeyPatch):
    """Make a manager the process-wide one, for explain() and the CLI."""

    def install(manager: PluginManager) -> PluginManager:
        monkeypatch.setattr(plugin_manager, "get_plugin_manager", lambda: manager)
        return manager

    return install


def _line(stdout: str, start: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(start)]
    assert len(lines) == 1, stdout
    return lines[0]


def _distribution(
    folder: Path, name: str, version: str, groups: dict[str, dict[str, str]], modules: dict
) -> None:
    """Write an installed distribution (metadata and modules) into ``folder``."""
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, entries in groups.items():
        lines += [f"[{group}]", *(f"{key} = {value}" for key, value in entries.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    for module, source in modules.items():
        (folder / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A function making a new folder on ``sys.path`` (later calls come later on the path)."""
    folders: list[Path] = []

    def new_folder() -> Path:
        folder = tmp_path / f"site{len(folders)}"
        folder.mkdir()
        folders.append(folder)
        monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])
        importlib.invalidate_caches()
        return folder

    return new_folder


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


REGISTERS = """
from explain_core import MethodSpec, hookimpl
from explain_gradients.methods import Gradient

@hookimpl
def explain_register_methods():
    return [MethodSpec({name!r}, Gradient, "test", "from a distribution")]
"""


# --- 2. what a method returns ----------------------------------------------------------------


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 3).eval()


X = torch.rand(2, 6, generator=torch.Generator().manual_seed(2))


@dataclasses.dataclass
class Returns(Method):
    """Returns what ``make(model, inputs, output, target)`` builds from a real forward pass."""

    make: object = None

    def attribute(self, model, inputs, target, baselines):
        output = model(inputs).detach()
        return self.make(inputs, output, select_target(output, target))  # type: ignore[misc]


BAD_RESULTS = {
    "tuple": (
        lambda x, out, t: (torch.zeros_like(x), out, t),
        r"method 'bad\.tuple' \(plugin 'bad'\) returned tuple; expected explain_core\.MethodResult",
    ),
    "scalar_shape": (
        lambda x, out, t: MethodResult(torch.zeros(3), out, t),
        r"'bad\.scalar_shape' \(plugin 'bad'\) returned an attribution of shape \(3,\); expected "
        r"the inputs' shape \(2, 6\)",
    ),
    "ndarray": (
        lambda x, out, t: MethodResult(x.numpy(), out, t),
        r"returned an attribution of type ndarray; expected a torch\.Tensor",
    ),
    "float_target": (
        lambda x, out, t: MethodResult(torch.zeros_like(x), out, t.float()),
        r"returned a target of dtype torch\.float32; expected integer class indices",
    ),
    "short_target": (
        lambda x, out, t: MethodResult(torch.zeros_like(x), out, torch.tensor([0])),
        r"returned a target of shape \(1,\); expected shape \(2,\)",
    ),
    "target_range": (
        lambda x, out, t: MethodResult(torch.zeros_like(x), out, torch.tensor([0, 3])),
        r"returned targets \[0, 3\] outside \[0, 2\]",
    ),
    "flat_output": (
        lambda x, out, t: MethodResult(torch.zeros_like(x), out[:, 0], t),
        r"returned an output of shape \(2,\); expected shape \(2, n_outputs\)",
    ),
    "delta_shape": (
        lambda x, out, t: MethodResult(torch.zeros_like(x), out, t, torch.zeros(2, 1)),
        r"returned a delta of shape \(2, 1\); expected shape \(2,\) or None",
    ),
    "nan_map": (
        lambda x, out, t: MethodResult(torch.full_like(x, float("nan")), out, t),
        r"'bad\.nan_map' \(plugin 'bad'\) returned NaN or infinite attributions",
    ),
    "inf_map": (
        lambda x, out, t: MethodResult(torch.full_like(x, float("inf")), out, t),
        r"returned NaN or infinite attributions for finite model outputs",
    ),
}


@pytest.mark.parametrize("kind", BAD_RESULTS)
def test_a_result_that_breaks_the_contract_names_method_and_plugin(use, kind: str) -> None:
    make, message = BAD_RESULTS[kind]
    spec = MethodSpec(f"bad.{kind}", lambda: Returns(make), "test", "bad result")
    use(_manager(("bad", _Plugin([spec]))))
    with pytest.raises(MethodError, match=message) as raised:
        explain(_linear(), X, f"bad.{kind}", 0)
    assert isinstance(raised.value, ExplainError)  # the CLI prints it as one line


def test_returned_tensors_are_detached_and_the_target_is_int64(use) -> None:
    def attached(x, out, t):
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            output = _linear()(x)
            (gradient,) = torch.autograd.grad(output[:, 0].sum(), x, create_graph=True)
        extras = {"graph": gradient * 2}
        return MethodResult(gradient * x, output, t.int(), output[:, 0] * 0, extras)

    spec = MethodSpec("bad.attached", lambda: Returns(attached), "test", "attached")
    use(_manager(("bad", _Plugin([spec]))))
    result = explain(_linear(), X, "bad.attached", 0)
    for tensor in (result.attribution, result.output, result.delta, result.extras["graph"]):
        assert not tensor.requires_grad and tensor.grad_fn is None
    assert result.target.dtype == torch.int64 and result.target.tolist() == [0, 0]
    weight = _linear().weight.detach()
    torch.testing.assert_close(result.attribution, X * weight[0])  # d out_0 / dx = W[0]


# --- 3. hook results that are not MethodSpec / DemoStep ---------------------------------------

BAD_ITEMS = {
    "strings": (["a.string"], r"returned str 'a\.string' as item 0 from explain_register_methods"),
    "none_name": (
        [MethodSpec(None, Gradient, "test", "no name")],  # type: ignore[arg-type]
        r"registers a method named None \(expected a non-empty str\)",
    ),
    "single_spec": (_specs("one")[0], r"returned MethodSpec .* instead of a list"),
    "a_str": ("gradient", r"returned str 'gradient' instead of a list"),
    "factory": ([MethodSpec("x.y", 42, "test", "")], r"registers 'x\.y' with the factory 42"),  # type: ignore[arg-type]
    "family": ([MethodSpec("x.y", Gradient, None, "")], r"registers 'x\.y' with the family None"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("kind", BAD_ITEMS)
def test_bad_hook_results_fail_only_that_plugin(use, kind: str) -> None:
    items, message = BAD_ITEMS[kind]
    manager = use(_manager(("broken", _Plugin(items)), ("fine", _Plugin(_specs("fine.one")))))
    with pytest.warns(PluginWarning, match=rf"'broken' \(registered in code\) {message}") as seen:
        registry = manager.registry
    assert len([w for w in seen if "broken" in str(w.message)]) == 1
    assert sorted(registry) == sorted([*GRADIENT_METHODS, "fine.one"])
    assert manager.plugins["broken"].error is not None
    assert manager.plugins["fine"].error is None
    assert explain(_linear(), X, "gradient", 1).attribution.shape == X.shape


class _Step(DemoStep):
    title = "good step"

    def run(self, context):
        return DemoSection(self.title)


class _DemoPlugin:
    def __init__(self, steps: object) -> None:
        self.steps = steps

    @hookimpl
    def explain_demo_steps(self) -> object:
        return self.steps


def test_demo_steps_that_are_not_demo_steps_fail_only_that_plugin() -> None:
    manager = _manager(("bad_demo", _DemoPlugin(["not a step"])), ("good", _DemoPlugin([_Step()])))
    with pytest.warns(PluginWarning, match=r"'bad_demo'.*returned str 'not a step' as item 0"):
        steps = manager.demo_steps()
    builtin = ("explain_gradients", "explain_core")
    assert [step.plugin for step in steps if step.plugin not in builtin] == ["good"]
    assert ("good step", "good") in [(step.title, step.plugin) for step in steps]


def test_explain_plugins_lists_a_plugin_with_bad_items_as_failed(use, capsys) -> None:
    use(_manager(("broken", _Plugin(["a.string"]))))
    code, out, err = run_cli(["plugins"], capsys)
    assert code == 1
    assert "Traceback" not in err
    assert _line(out, "explain_gradients ").endswith("(built-in) - 5 methods")
    assert _line(out, "broken ").startswith(
        "broken unknown (registered in code) - FAILED: returned"
    )


# --- 4. duplicate method names ---------------------------------------------------------------


@pytest.mark.parametrize("builtins_first", [True, False], ids=["after", "before"])
def test_a_third_party_method_named_like_a_builtin_is_skipped(use, builtins_first, capsys):
    copycat = _Plugin(_specs("copy.unique", "gradient"))
    with pytest.warns(PluginWarning) as seen:
        manager = use(_manager(("copycat", copycat), builtins_first=builtins_first))
        registry = manager.registry
    messages = [str(w.message) for w in seen]
    assert len(messages) == 1, messages
    assert "'copycat'" in messages[0] and "'explain_gradients'" in messages[0]
    assert "'gradient'" in messages[0]
    assert registry["gradient"].plugin == "explain_gradients"
    assert registry["gradient"].builtin
    assert registry["copy.unique"].plugin == "copycat" and not registry["copy.unique"].builtin
    assert manager.plugins["copycat"].methods == ["copy.unique"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)  # said once, not on every rebuild
        manager.register(_Plugin(_specs("late.one")), "late")
        assert "late.one" in manager.registry
    code, out, _ = run_cli(["plugins"], capsys)
    assert code == 1
    line = _line(out, "copycat ")
    assert line.startswith("copycat unknown (registered in code) - 1 method; method 'gradient'")
    assert "explain_gradients" in line


def test_two_third_party_plugins_clashing_still_get_listed(use, capsys) -> None:
    manager = use(
        _manager(
            ("first", _Plugin(_specs("shared.name", "first.own"))),
            ("second", _Plugin(_specs("shared.name"))),
        )
    )
    with pytest.raises(DuplicateMethodError, match=r"'shared\.name'.*'first' and 'second'"):
        _ = manager.registry
    with pytest.raises(DuplicateMethodError):
        explain(_linear(), X, "gradient", 0)  # documented: an error naming both
    code, out, err = run_cli(["plugins"], capsys)
    assert code == 1, err
    assert "Traceback" not in err
    assert _line(out, "explain_gradients ").endswith("- 5 methods")
    first = _line(out, "first ")
    assert first.startswith("first unknown (registered in code) - 1 method; method 'shared.name'")
    assert "'first' and 'second'" in _line(out, "second ")
    assert "    first.own" in out and "shared.name " not in out.replace("'shared.name'", "")


def test_a_plugin_registering_a_name_twice_is_named_once(use) -> None:
    manager = use(_manager(("twice", _Plugin(_specs("p.name", "p.name")))))
    with pytest.warns(PluginWarning, match=r"plugin 'twice' .*registers 'p\.name' twice") as seen:
        registry = manager.registry
    assert "two plugins" not in str(seen[0].message)
    assert sorted(registry) == GRADIENT_METHODS


# --- 5. export forms, commands and jobs of third-party plugins ------------------------------


def _build(model, example, target_input, **options):
    raise RuntimeError("third-party build")


def _reference(model, x, target, **options):
    raise RuntimeError("third-party reference")


class _Forms:
    def __init__(self, forms: object) -> None:
        self.forms = forms

    @hookimpl
    def explain_register_export_forms(self) -> object:
        return self.forms


def test_export_forms_of_third_parties_cannot_replace_builtins_or_register_half_a_list() -> None:
    fine = ExportForm("third.fine", _build, _reference, "fine")
    manager = PluginManager()
    manager.load(entry_points=False)
    manager.register(_Forms([fine]), "fine")
    manager.register(
        _Forms([ExportForm("input_x_gradient", _build, _reference, "replaces")]), "override"
    )
    manager.register(_Forms([ExportForm("third.half", _build, _reference), "x"]), "half")
    with pytest.warns(PluginWarning) as seen:
        forms = manager.export_forms()
    messages = [str(w.message) for w in seen]
    assert any("'override'" in m and "'input_x_gradient'" in m for m in messages), messages
    assert any("'half'" in m and "str 'x' as item 1" in m for m in messages), messages
    assert forms["input_x_gradient"].description.startswith("Input×Gradient")
    assert manager.owner("explain_register_export_forms", "input_x_gradient") == "explain_onnx"
    assert forms["third.fine"] is fine
    assert "third.half" not in forms
    assert manager.plugins["half"].error is not None


class _Commands:
    @hookimpl
    def explain_register_commands(self) -> object:
        def broken(parser):
            raise RuntimeError("cannot set up")

        return [Command("broken-cmd", "h", "d", broken, lambda args: 0)]


def test_a_command_that_cannot_set_up_its_arguments_fails_alone(use, capsys) -> None:
    manager = PluginManager()
    manager.load(entry_points=False)
    manager.register(_Commands(), "cmd")
    use(manager)
    _, out, err = run_cli(["plugins"], capsys)
    assert "'broken-cmd' of plugin 'cmd' could not set up its arguments" in err
    assert "explain_gradients" in out


# --- 6. two distributions declaring the same entry-point name --------------------------------


def test_a_twin_entry_point_is_reported_not_dropped(site, monkeypatch, use, capsys) -> None:
    name = _unique("twin")
    for dist, version, method in (("twin-a", "1.0", "twin.a"), ("twin-b", "2.0", "twin.b")):
        module = _unique(dist.replace("-", "_"))
        groups = {"explain.plugins": {name: module}}
        _distribution(site(), dist, version, groups, {module: REGISTERS.format(name=method)})
    monkeypatch.setenv(ENV_VARIABLE, name)
    manager = PluginManager()
    with pytest.warns(PluginWarning, match=rf"'{name}' \(entry point of twin-b\) not loaded"):
        manager.load(builtins=(), entry_points=True)
    assert sorted(manager.registry) == ["twin.a"]
    use(manager)
    code, out, _ = run_cli(["plugins"], capsys)
    assert code == 1
    assert _line(out, f"{name} 1.0 ").endswith("(entry point of twin-a) - 1 method")
    twin = _line(out, f"{name} 2.0 ")
    # 9. The source appears once, the reason names the plugin already loaded.
    assert twin == (
        f"{name} 2.0 (entry point of twin-b) - FAILED: not loaded: a plugin named {name!r} is "
        "already loaded (entry point of twin-a); rename or uninstall one of them"
    )


# --- 7. sys.exit and KeyboardInterrupt in a plugin --------------------------------------------


def test_sys_exit_at_import_fails_alone_and_keyboard_interrupt_still_stops(site, monkeypatch):
    exits, fine, stops = _unique("exits"), _unique("fine"), _unique("stops")
    modules = {
        exits: "import sys\nsys.exit('bye')\n",
        fine: REGISTERS.format(name="fine.one"),
        stops: "raise KeyboardInterrupt\n",
    }
    groups = {"explain.plugins": {exits: exits, fine: fine, stops: stops}}
    _distribution(site(), "exiting-plugins", "1.0", groups, modules)
    monkeypatch.setenv(ENV_VARIABLE, f"{exits},{fine}")
    manager = PluginManager()
    with pytest.warns(PluginWarning, match=rf"'{exits}'.*SystemExit.*sys\.exit\('bye'\)"):
        manager.load(builtins=(), entry_points=True)
    assert "SystemExit" in manager.plugins[exits].error
    assert list(manager.registry) == ["fine.one"]
    # its method is not "unknown, did you mean …": the failed plugin is named first
    with pytest.raises(UnknownMethodError, match=rf"may belong to a plugin that failed.*'{exits}'"):
        manager.registry["exits.method"]
    monkeypatch.setenv(ENV_VARIABLE, stops)  # Ctrl-C while a plugin imports: the user's wish
    with pytest.raises(KeyboardInterrupt):
        PluginManager().load(builtins=(), entry_points=True)


def test_sys_exit_in_a_hook_fails_only_that_plugin() -> None:
    class Exits:
        @hookimpl
        def explain_register_methods(self):
            sys.exit(3)

    manager = _manager(("exits", Exits()))
    with pytest.warns(PluginWarning, match=r"'exits'.*SystemExit"):
        assert sorted(manager.registry) == GRADIENT_METHODS


# --- 8. errors that name the plugin ----------------------------------------------------------


def test_a_factory_that_builds_no_method_is_named(use) -> None:
    specs = [
        MethodSpec("nb.dict", dict, "test", "a builtin type"),
        MethodSpec("nb.object", lambda: object(), "test", "builds object()"),
    ]
    use(_manager(("notebook", _Plugin(specs))))
    with pytest.raises(MethodError, match=r"method 'nb\.dict' \(plugin 'notebook'\).*factory"):
        explain(_linear(), X, "nb.dict")
    with pytest.raises(
        MethodError, match=r"method 'nb\.object' \(plugin 'notebook'\).*built object; expected"
    ):
        explain(_linear(), X, "nb.object")


@dataclasses.dataclass
class Raises(Method):
    def attribute(self, model, inputs, target, baselines):
        model(inputs)  # the model runs fine: the error is the method's own
        raise KeyError("missing table")


def test_an_error_escaping_a_third_party_method_names_it(use) -> None:
    use(_manager(("raising", _Plugin([MethodSpec("r.m", Raises, "test", "raises")]))))
    with pytest.raises(MethodError, match=r"method 'r\.m' \(plugin 'raising'\) raised KeyError"):
        explain(_linear(), X, "r.m", 0)
    try:
        explain(_linear(), X, "r.m", 0)
    except MethodError as error:
        assert isinstance(error.__cause__, KeyError)  # the plugin's error, chained


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``explain attribute`` arguments for a Linear(6, 3) model on one .npy input."""
    module = write_user_module(
        tmp_path,
        monkeypatch,
        "robustmodels",
        "from torch import nn\n\n\ndef build():\n    return nn.Linear(6, 3)\n",
    )
    save_file(dict(_linear().state_dict()), str(tmp_path / "w.safetensors"))
    np.save(tmp_path / "x.npy", np.linspace(0, 1, 6, dtype=np.float32))
    return ["attribute", "x.npy", "--model", f"{module}:build", "--weights", "w.safetensors"]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("bad.scalar_shape", r"'bad\.scalar_shape' \(plugin 'bad'\) returned an attribution of"),
        ("r.m", r"'r\.m' \(plugin 'bad'\) raised KeyError"),
    ],
)
def test_cli_attribute_gives_one_line_and_writes_nothing(use, project, capsys, method, message):
    make, _ = BAD_RESULTS["scalar_shape"]
    specs = [
        MethodSpec("bad.scalar_shape", lambda: Returns(make), "test", "wrong shape"),
        MethodSpec("r.m", Raises, "test", "raises"),
    ]
    use(_manager(("bad", _Plugin(specs))))
    code, _, err = run_cli([*project, "--method", method, "--out", "maps"], capsys)
    assert code == 1
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("explain: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert not Path("maps").exists()


# --- 9. explain plugins prints one line per failure ------------------------------------------


class _UnknownArgument:
    @hookimpl
    def explain_register_methods(self, config):
        return []


def test_a_multi_line_failure_is_listed_on_one_line(use, capsys) -> None:
    with pytest.warns(PluginWarning):
        manager = use(_manager(("badarg", _UnknownArgument())))
    assert "\n" not in manager.plugins["badarg"].error
    code, out, _ = run_cli(["plugins"], capsys)
    assert code == 1
    assert all(
        line.startswith(("explain_core ", "explain_gradients ", "badarg ", "    "))
        for line in out.splitlines()
    )
    assert "config" in _line(out, "badarg ")


class _Exits(Method):
    def attribute(self, model, inputs, target, baselines):
        sys.exit(0)  # must not look like success


def _exiting_factory():
    raise SystemExit(0)


def test_sys_exit_in_a_method_or_its_factory_is_a_named_failure(use, project, capsys) -> None:
    specs = [
        MethodSpec("x.method", _Exits, "test", "exits"),
        MethodSpec("x.factory", _exiting_factory, "test", "exits while built"),
    ]
    use(_manager(("exiting", _Plugin(specs))))
    for method in ("x.method", "x.factory"):
        with pytest.raises(
            MethodError, match=rf"'{method}' \(plugin 'exiting'\) raised SystemExit"
        ):
            explain(_linear(), X, method, 0)
        code, _, err = run_cli([*project, "--method", method, "--out", "maps"], capsys)
        assert code == 1 and "raised SystemExit" in err, err
        assert not Path("maps").exists()
        check = ["check", *project[1:], "--method", method, "--out", "card.json"]
        code, _, err = run_cli(check, capsys)
        assert code == 1 and "raised SystemExit" in err, err
        assert not Path("card.json").exists()
