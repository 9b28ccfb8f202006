"""Finding, loading and isolating plugins with pluggy.

Built-in plugins (:data:`BUILTIN_PLUGINS`) are registered through the same hooks as third-party
ones; third-party plugins come from the ``explain.plugins`` entry-point group. Every plugin is
imported, registered and called in its own ``try``: one that fails is reported as a warning and
listed by ``explain plugins``, and everything else keeps working.

The environment variable ``EXPLAIN_PLUGINS`` controls autoloading of third-party plugins:
unset loads all of them, an empty value (or ``none``) loads none, and a comma-separated list of
entry-point names loads only those.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from explain_core import hookspecs
from explain_core.errors import DuplicateMethodError
from explain_core.registry import MethodRegistry, MethodSpec

BUILTIN_PLUGINS: tuple[str, ...] = (
    "explain_gradients",
    "explain_coda",
    "explain_capsules",
    "explain_modbp",
)
"""Modules of the plugins that ship with the package, loaded like entry points but always on."""

ENV_VARIABLE = "EXPLAIN_PLUGINS"


class PluginWarning(UserWarning):
    """A plugin could not be loaded or failed while registering; the others still work."""


@dataclass
class PluginInfo:
    """A plugin as ``explain plugins`` reports it.

    Attributes:
        name: Plugin name (the entry-point name, or the module name of a built-in).
        version: Version of the distribution that provides it.
        source: ``"built-in"`` or ``"entry point of <distribution>"``.
        error: Why the plugin failed to load or register, or ``None``.
        methods: Names of the methods it registers.
    """

    name: str
    version: str
    source: str
    error: str | None = None
    methods: list[str] = field(default_factory=list)


class PluginManager:
    """The loaded plugins and the method registry built from them."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._registry: MethodRegistry | None = None

    def load(self, builtins: Sequence[str] = BUILTIN_PLUGINS, entry_points: bool = True) -> None:
        """Register the built-in plugins and, unless switched off, the entry-point plugins."""
        version = package_version()
        for module_name in builtins:
            self._load_one(module_name, version, "built-in", lambda m=module_name: _import(m))
        if entry_points:
            for entry_point in _selected_entry_points():
                dist = entry_point.dist
                self._load_one(
                    entry_point.name,
                    dist.version if dist else "unknown",
                    f"entry point of {dist.name if dist else 'an unknown distribution'}",
                    entry_point.load,
                )
        self._check_pending()

    def register(self, plugin: object, name: str, version: str = "", source: str = "") -> None:
        """Register an already imported plugin object (used by tests and notebooks)."""
        self._load_one(name, version or "unknown", source or "registered in code", lambda: plugin)
        self._check_pending()

    @property
    def registry(self) -> MethodRegistry:
        """Method name → specification over all plugins that registered successfully.

        Raises:
            DuplicateMethodError: If two plugins register the same method name.
        """
        if self._registry is None:
            self._registry = self._build_registry()
        return self._registry

    def demo_steps(self) -> list[Any]:
        """Demo steps from all plugins, in their declared order."""
        steps: list[Any] = []
        for plugin_name, results in self._call_each("explain_demo_steps"):
            for step in results:
                step.plugin = plugin_name
                steps.append(step)
        return sorted(steps, key=lambda step: (step.order, step.title))

    def _load_one(self, name: str, version: str, source: str, load: Callable[[], object]) -> None:
        if name in self.plugins:  # never let a newcomer displace a plugin that already works
            clash = PluginInfo(f"{name} ({source})", version, source)
            self.plugins[clash.name] = clash
            self._fail(clash, f"not loaded: a plugin named {name!r} is already loaded")
            return
        info = PluginInfo(name, version, source)
        self.plugins[name] = info
        try:
            plugin = load()
            if self.pm.is_registered(plugin):
                raise ValueError(f"the same plugin object is already registered as {name!r}")
            self.pm.register(plugin, name=name)
        except Exception as error:
            self._fail(info, f"failed to load: {type(error).__name__}: {error}")
        self._registry = None

    def _check_pending(self) -> None:
        # A misspelled hook name only surfaces here; drop the offending plugin, keep the rest.
        while True:
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as error:
                name = self.pm.get_name(error.plugin) or str(error.plugin)
                self.pm.unregister(error.plugin)
                info = self.plugins.setdefault(name, PluginInfo(name, "unknown", "registered"))
                self._fail(info, str(error))

    def _fail(self, info: PluginInfo, reason: str) -> None:
        info.error = reason
        warnings.warn(
            f"explain plugin {info.name!r} ({info.source}) {reason}; the other plugins still work",
            PluginWarning,
            stacklevel=3,
        )

    def _call_each(self, hook_name: str) -> list[tuple[str, Sequence[Any]]]:
        """Call one hook plugin by plugin, so a failure is attributed and isolated."""
        results = []
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            info = self.plugins.get(impl.plugin_name)
            if info is not None and info.error:
                continue
            try:
                results.append((impl.plugin_name, list(impl.function() or ())))
            except Exception as error:
                if info is not None:
                    self._fail(info, f"raised in {hook_name}: {type(error).__name__}: {error}")
        return results

    def _build_registry(self) -> MethodRegistry:
        specs: dict[str, MethodSpec] = {}
        for plugin_name, results in self._call_each("explain_register_methods"):
            for spec in results:
                if spec.name in specs:
                    raise DuplicateMethodError(
                        f"method {spec.name!r} is registered by two plugins, "
                        f"{specs[spec.name].plugin!r} and {plugin_name!r}; uninstall one of them "
                        f"or restrict loading with {ENV_VARIABLE}=<names>"
                    )
                specs[spec.name] = MethodSpec(
                    spec.name, spec.factory, spec.family, spec.summary, plugin_name
                )
        for info in self.plugins.values():
            info.methods = sorted(n for n, s in specs.items() if s.plugin == info.name)
        return MethodRegistry(specs)


def _import(module_name: str) -> ModuleType:
    return importlib.import_module(module_name)


def _selected_entry_points() -> list[metadata.EntryPoint]:
    setting = os.environ.get(ENV_VARIABLE)
    found = list(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))
    if setting is None:
        return _unique_by_name(found)
    wanted = {name.strip() for name in setting.split(",") if name.strip()} - {"none"}
    missing = wanted - {ep.name for ep in found}
    if missing:
        warnings.warn(
            f"{ENV_VARIABLE} names plugins that are not installed: {', '.join(sorted(missing))}",
            PluginWarning,
            stacklevel=3,
        )
    return _unique_by_name([ep for ep in found if ep.name in wanted])


def _unique_by_name(entry_points: list[metadata.EntryPoint]) -> list[metadata.EntryPoint]:
    # The same distribution can be visible twice on sys.path (e.g. an editable install plus a
    # build directory); load each entry point name once.
    unique: dict[str, metadata.EntryPoint] = {}
    for entry_point in entry_points:
        unique.setdefault(entry_point.name, entry_point)
    return list(unique.values())


def package_version() -> str:
    """Version of the installed distribution, or ``"0+unknown"`` when running from a checkout."""
    try:
        return metadata.version("explain-torch")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@lru_cache(maxsize=1)
def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    manager = PluginManager()
    manager.load()
    return manager


def get_registry() -> MethodRegistry:
    """The method registry of the process-wide plugin manager."""
    return get_plugin_manager().registry


def reset_plugin_manager() -> None:
    """Forget the loaded plugins so the next use loads them again (e.g. after installing one)."""
    get_plugin_manager.cache_clear()
