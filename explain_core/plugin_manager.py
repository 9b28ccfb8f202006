"""Finding, loading and isolating plugins with pluggy.

Plugins come from the ``explain.plugins`` entry-point group: the built-in ones are the entry points
of the ``explain-torch`` distribution itself, third-party ones those of any other distribution.
Both register through the same hooks (:mod:`explain_core.hookspecs`), as does the core's own
internal plugin (:mod:`explain_core.builtin`: the core's commands and jobs). Every plugin is
imported, registered and called in its own ``try``: one that fails (it raises, even
``SystemExit``, or its hooks return anything but the documented objects) is reported as a warning
and listed by ``explain plugins``, and everything else keeps working. A third-party method (or
command, job, export form) named like a built-in one is left out with a warning; two third-party
plugins registering the same method name make :attr:`PluginManager.registry` raise
:class:`~explain_core.errors.DuplicateMethodError` naming both. A second distribution declaring
an entry-point name already loaded is reported, not loaded.

The environment variable ``EXPLAIN_PLUGINS`` controls autoloading of third-party plugins:
unset loads all of them, an empty value (or ``none``) loads none, and a comma-separated list of
entry-point names loads only those. Built-in plugins are always loaded.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from explain_core import hookspecs
from explain_core.errors import DuplicateMethodError
from explain_core.registry import MethodRegistry, MethodSpec

DISTRIBUTION = "explain-torch"
"""The distribution whose entry points are the built-in plugins."""
CORE_PLUGIN = "explain_core"
"""Name of the core's internal plugin (its commands and jobs), always registered."""
ENV_VARIABLE = "EXPLAIN_PLUGINS"
BUILTIN_SOURCE = "built-in"


class PluginWarning(UserWarning):
    """A plugin could not be loaded or failed while registering; the others still work."""


@dataclass
class PluginInfo:
    """A plugin as ``explain plugins`` reports it.

    Attributes:
        name: Plugin name (the entry-point name, or the module name of a built-in).
        version: Version of the distribution that provides it.
        source: ``"built-in"`` or ``"entry point of <distribution>"``.
        error: Why the plugin failed to load or register (one line), or ``None``.
        methods: Names of the methods it registers.
        problems: Methods of it that were left out while the rest of it works (a name a
            built-in plugin has, or that another plugin registers too), one line each.
    """

    name: str
    version: str
    source: str
    error: str | None = None
    methods: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def builtin(self) -> bool:
        """Whether the plugin ships with the package."""
        return self.source == BUILTIN_SOURCE


class PluginManager:
    """The loaded plugins and the method registry built from them."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._registry: MethodRegistry | None = None
        self._clashes: list[str] = []
        self._warned: set[str] = set()  # problems found again on every rebuild warn once
        self._named_cache: dict[str, dict[str, Any]] = {}
        self._owners: dict[tuple[str, str], str] = {}

    def load(self, builtins: Sequence[str] | None = None, entry_points: bool = True) -> None:
        """Register the core's plugin, the built-in plugins and, unless off, third-party ones.

        Args:
            builtins: Names of the built-in plugins to load (``None``: all of them).
            entry_points: Load third-party plugins (as ``EXPLAIN_PLUGINS`` selects them).
        """
        version = package_version()
        self._load_one(
            CORE_PLUGIN, version, BUILTIN_SOURCE, lambda: _import(f"{CORE_PLUGIN}.builtin")
        )
        own, others = _split_by_distribution(
            _unique(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))
        )
        if not own:
            warnings.warn(
                f"the {DISTRIBUTION} distribution is not installed (no metadata found), so its "
                "built-in plugins are not loaded: install it (pip install -e . in a checkout)",
                PluginWarning,
                stacklevel=2,
            )
        wanted = None if builtins is None else set(builtins)
        for entry_point in own:
            if wanted is None or entry_point.name in wanted:
                self._load_one(entry_point.name, version, BUILTIN_SOURCE, entry_point.load)
        for name in sorted((wanted or set()) - {ep.name for ep in own}):
            self._fail(
                self._info(name, BUILTIN_SOURCE),
                f"failed to load: no built-in plugin is named {name!r} (built-in: "
                f"{', '.join(ep.name for ep in own)})",
            )
        if entry_points:
            for entry_point in selected_entry_points(others):
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

        A third-party method named like a built-in one is left out with a
        :class:`PluginWarning` (the built-in keeps the name).

        Raises:
            DuplicateMethodError: If two third-party plugins (or two built-in ones) register
                the same method name.
        """
        registry = self.registry_without_clashes()
        if self._clashes:
            raise DuplicateMethodError("; also ".join(self._clashes))
        return registry

    def registry_without_clashes(self) -> MethodRegistry:
        """The registry without the names that plugins clash on, for listings.

        ``explain plugins`` must list the plugins also when two of them clash, so that the user
        can find the culprit; each clash is in the ``problems`` of the plugins involved.
        """
        if self._registry is None:
            self._registry, self._clashes = self._build_registry()
        return self._registry

    def commands(self) -> dict[str, Any]:
        """Subcommand name → :class:`~explain_core.cli.command.Command`, from every plugin."""
        from explain_core.cli.command import Command

        return self._named("explain_register_commands", Command, "explain_core Command")

    def jobs(self) -> dict[str, Any]:
        """Job name → :class:`~explain_core.distributed.jobs.Job`, from every plugin."""
        from explain_core.distributed.jobs import Job

        return self._named("explain_register_jobs", Job, "explain_core Job")

    def export_forms(self) -> dict[str, Any]:
        """Method name → :class:`~explain_core.export_forms.ExportForm`, from every plugin."""
        from explain_core.export_forms import ExportForm

        return self._named("explain_register_export_forms", ExportForm, "ExportForm")

    def export_adapters(self) -> dict[type, Any]:
        """Model type → :class:`~explain_core.export_forms.ExportAdapter`, from every plugin."""
        from explain_core.export_forms import ExportAdapter

        adapters = self._named("explain_register_export_adapters", ExportAdapter, "ExportAdapter")
        return {adapter.model_type: adapter for adapter in adapters.values()}

    def composites(self) -> dict[str, Any]:
        """Composite name → :class:`~explain_core.interfaces.relevance.CompositeSpec`."""
        from explain_core.interfaces.relevance import CompositeSpec

        return self._named("explain_register_composites", CompositeSpec, "CompositeSpec")

    def owner(self, hook_name: str, name: str) -> str:
        """The plugin whose item ``name`` of hook ``hook_name`` is used (``""`` if none)."""
        return self._owners.get((hook_name, name), "")

    def _named(self, hook_name: str, item_type: type, expected: str) -> dict[str, Any]:
        """Items of one hook by their ``name``: built-ins first, then in loading order.

        A name already taken is skipped with a :class:`PluginWarning` naming both plugins (a
        built-in keeps its name); an item without a non-empty ``str`` name fails its plugin.
        """
        if hook_name in self._named_cache:
            return self._named_cache[hook_name]
        results = self._call_each(hook_name, item_type, expected)
        results.sort(key=lambda pair: not self._info(pair[0]).builtin)
        chosen: dict[str, Any] = {}
        for plugin_name, items in results:
            info = self._info(plugin_name)
            unnamed = [item for item in items if not (isinstance(item.name, str) and item.name)]
            if unnamed:
                self._fail(info, f"returned {_short(unnamed[0])} without a name from {hook_name}")
                continue
            for item in items:
                taken = self._owners.get((hook_name, item.name))
                if item.name in chosen and taken != plugin_name:
                    message = (
                        f"explain plugin {info.name!r} ({info.source}): {item.name!r} from "
                        f"{hook_name} skipped: plugin {taken!r} registers that name and keeps it"
                    )
                    if message not in self._warned:
                        self._warned.add(message)
                        warnings.warn(message, PluginWarning, stacklevel=3)
                    continue
                chosen[item.name] = item
                self._owners[(hook_name, item.name)] = plugin_name
        self._named_cache[hook_name] = chosen
        return chosen

    def demo_steps(self) -> list[Any]:
        """Demo steps from all plugins, in their declared order.

        A plugin whose ``explain_demo_steps`` raises or returns anything but ``DemoStep``
        objects fails alone, with a :class:`PluginWarning`.
        """
        from explain_core.demo import DemoStep

        steps: list[Any] = []
        for plugin_name, results in self._call_each(
            "explain_demo_steps", DemoStep, "explain_core.demo.DemoStep"
        ):
            for step in results:
                step.plugin = plugin_name
                steps.append(step)
        return sorted(steps, key=lambda step: (step.order, step.title))

    def _load_one(self, name: str, version: str, source: str, load: Callable[[], object]) -> None:
        if name in self.plugins:  # never let a newcomer displace a plugin that already works
            loaded = self.plugins[name]
            clash = PluginInfo(name, version, source)
            self.plugins[self._spare_key(f"{name} ({source})")] = clash
            self._fail(
                clash,
                f"not loaded: a plugin named {name!r} is already loaded ({loaded.source}); "
                "rename or uninstall one of them",
            )
            return
        info = PluginInfo(name, version, source)
        self.plugins[name] = info
        try:
            plugin = load()
            if self.pm.is_registered(plugin):
                raise ValueError(f"the same plugin object is already registered as {name!r}")
            self.pm.register(plugin, name=name)
        except (Exception, SystemExit) as error:  # sys.exit() in a plugin must not end the host
            self._fail(info, f"failed to load: {_describe(error)}")
        self._registry = None
        self._named_cache.clear()
        self._owners.clear()

    def _spare_key(self, key: str) -> str:
        """``key``, numbered if taken: every rejected twin keeps its own listing entry."""
        spare, number = key, 1
        while spare in self.plugins:
            number += 1
            spare = f"{key} #{number}"
        return spare

    def _check_pending(self) -> None:
        # A misspelled hook name only surfaces here; drop the offending plugin, keep the rest.
        while True:
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as error:
                name = self.pm.get_name(error.plugin) or str(error.plugin)
                self.pm.unregister(error.plugin)
                self._fail(self._info(name), str(error))

    def _info(self, name: str, source: str = "registered") -> PluginInfo:
        """The loaded plugin registered under ``name`` (one put into ``pm`` directly, too)."""
        return self.plugins.setdefault(name, PluginInfo(name, "unknown", source))

    def _fail(self, info: PluginInfo, reason: str) -> None:
        info.error = _one_line(reason)
        warnings.warn(
            f"explain plugin {info.name!r} ({info.source}) {info.error}; the other plugins still "
            "work",
            PluginWarning,
            stacklevel=3,
        )

    def _call_each(
        self, hook_name: str, item_type: type, expected: str
    ) -> list[tuple[str, list[Any]]]:
        """Call one hook plugin by plugin, so a failure is attributed and isolated.

        A plugin whose hook raises, or returns anything but a list of ``item_type``, fails as
        a whole; the results of the others come back, in registration order.
        """
        collected: dict[str, list[Any]] = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            info = self._info(impl.plugin_name)
            if info.error:
                continue
            try:
                returned = impl.function()
                items = _as_list(returned)
            except (Exception, SystemExit) as error:
                self._fail(info, f"raised in {hook_name}: {_describe(error)}")
                continue
            problem = _items_problem(returned, items, item_type)
            if items is None or problem is not None:
                self._fail(
                    info,
                    f"returned {problem} from {hook_name}, where a list of {expected} is "
                    "expected, so it is not used",
                )
                continue
            collected.setdefault(impl.plugin_name, []).extend(items)
        # A plugin with several implementations may have failed in a later one.
        return [(name, items) for name, items in collected.items() if not self._info(name).error]

    def _build_registry(self) -> tuple[MethodRegistry, list[str]]:
        claims: dict[str, list[MethodSpec]] = {}
        for plugin_name, results in self._call_each(
            "explain_register_methods", MethodSpec, "explain_core.MethodSpec"
        ):
            info = self._info(plugin_name)
            problem = _specs_problem(results)
            if problem is not None:
                self._fail(info, f"{problem}, so it is not used")
                continue
            for spec in results:
                # plugin and builtin come from where it was loaded, never from the plugin.
                claimed = dataclasses.replace(spec, plugin=plugin_name, builtin=info.builtin)
                claims.setdefault(spec.name, []).append(claimed)
        for info in self.plugins.values():
            info.problems = []
        specs: dict[str, MethodSpec] = {}
        clashes = []
        for name, claimants in claims.items():
            builtins = [spec for spec in claimants if spec.builtin]
            if len(claimants) == 1:
                specs[name] = claimants[0]
            elif len(builtins) == 1:  # a third-party plugin must not disable a built-in method
                specs[name] = builtins[0]
                for spec in claimants:
                    if not spec.builtin:
                        self._skip_shadowing(spec, builtins[0].plugin)
            else:
                clashes.append(self._clash(name, [spec.plugin for spec in claimants]))
        for info in self.plugins.values():
            names = (n for n, s in specs.items() if s.plugin == info.name)
            # A rejected twin has the same name as the loaded plugin but none of its methods.
            info.methods = sorted(names) if self.plugins.get(info.name) is info else []
        failed = {info.name: info.error for info in self.plugins.values() if info.error}
        return MethodRegistry(specs, failed), clashes

    def _skip_shadowing(self, spec: MethodSpec, builtin: str) -> None:
        problem = (
            f"method {spec.name!r} skipped: the built-in plugin {builtin!r} registers that name "
            "and keeps it"
        )
        info = self._info(spec.plugin)
        info.problems.append(problem)
        message = (
            f"explain plugin {info.name!r} ({info.source}): {problem}; its other methods still work"
        )
        if message not in self._warned:  # the registry is rebuilt after every registration
            self._warned.add(message)
            warnings.warn(message, PluginWarning, stacklevel=5)

    def _clash(self, name: str, plugins: list[str]) -> str:
        quoted = [repr(plugin) for plugin in plugins]
        count = "two" if len(plugins) == 2 else str(len(plugins))
        message = (
            f"method {name!r} is registered by {count} plugins, {', '.join(quoted[:-1])} and "
            f"{quoted[-1]}; uninstall one of them or restrict loading with "
            f"{ENV_VARIABLE}=<names>"
        )
        for plugin in plugins:
            self._info(plugin).problems.append(message)
        return message


def _import(module_name: str) -> ModuleType:
    return importlib.import_module(module_name)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _describe(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"SystemExit: it called sys.exit({error.code!r})"
    return f"{type(error).__name__}: {error}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_list(returned: Any) -> list[Any] | None:
    """A hook's result as a list (``None`` counts as empty), or ``None`` if it is no list."""
    if returned is None:
        return []
    if isinstance(returned, Iterable) and not isinstance(returned, (str, bytes, Mapping)):
        return list(returned)  # a list, a tuple or e.g. a generator
    return None


def _items_problem(returned: Any, items: list[Any] | None, item_type: type) -> str | None:
    """What is wrong with a hook's result (``items``: it as a list), or ``None``."""
    if items is None:
        return f"{type(returned).__name__} {_short(returned)} instead of a list"
    for index, item in enumerate(items):
        if not isinstance(item, item_type):
            return f"{type(item).__name__} {_short(item)} as item {index}"
    return None


def _specs_problem(specs: list[MethodSpec]) -> str | None:
    """What is wrong with one plugin's method specifications, or ``None``."""
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec.name, str) or not spec.name.strip():
            return f"registers a method named {spec.name!r} (expected a non-empty str)"
        if spec.name in seen:
            return f"registers {spec.name!r} twice"
        seen.add(spec.name)
        if not callable(spec.factory):
            return (
                f"registers {spec.name!r} with the factory {_short(spec.factory)} (expected a "
                "callable that builds an explain_core.Method, usually the Method subclass)"
            )
        for attribute in ("family", "summary"):
            value = getattr(spec, attribute)
            if not isinstance(value, str):
                return (
                    f"registers {spec.name!r} with the {attribute} {_short(value)} (expected a str)"
                )
    return None


def selected_entry_points(
    entry_points: Sequence[metadata.EntryPoint],
) -> list[metadata.EntryPoint]:
    """The third-party ``entry_points`` that ``EXPLAIN_PLUGINS`` selects (all while it is unset).

    Names it selects that are not installed are warned about.
    """
    setting = os.environ.get(ENV_VARIABLE)
    if setting is None:
        return list(entry_points)
    wanted = {name.strip() for name in setting.split(",") if name.strip()} - {"none"}
    missing = wanted - {ep.name for ep in entry_points}
    if missing:
        warnings.warn(
            f"{ENV_VARIABLE} names plugins that are not installed: {', '.join(sorted(missing))}",
            PluginWarning,
            stacklevel=3,
        )
    return [ep for ep in entry_points if ep.name in wanted]


def _split_by_distribution(
    entry_points: Sequence[metadata.EntryPoint],
) -> tuple[list[metadata.EntryPoint], list[metadata.EntryPoint]]:
    """``(built-in, third-party)``: entry points of this distribution, and of any other."""
    own = [ep for ep in entry_points if _dist_key(ep) == DISTRIBUTION]
    return own, [ep for ep in entry_points if _dist_key(ep) != DISTRIBUTION]


def _unique(entry_points: Iterable[metadata.EntryPoint]) -> list[metadata.EntryPoint]:
    # The same distribution can be visible twice on sys.path (e.g. an editable install plus a
    # build directory): load its entry point once. Two distributions declaring the same name
    # are both kept, so that the second is reported as a clash instead of silently dropped.
    unique: dict[tuple[str, str, str], metadata.EntryPoint] = {}
    for entry_point in entry_points:
        unique.setdefault(
            (entry_point.name, entry_point.value, _dist_key(entry_point)), entry_point
        )
    return list(unique.values())


def _dist_key(entry_point: metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return re.sub(r"[-_.]+", "-", dist.name).lower() if dist is not None else ""


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
