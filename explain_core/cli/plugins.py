"""``explain plugins``: the loaded plugins, their versions and what each registers."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by run() only, so that --help works with broken plugins
    from explain_core.plugin_manager import PluginInfo, PluginManager
    from explain_core.registry import MethodRegistry, MethodSpec

NAME = "plugins"
HELP = "list plugins, versions and the methods they register"
DESCRIPTION = (
    "List the loaded plugins (built-in and installed through the 'explain.plugins' entry-point "
    "group), their versions, methods, commands, jobs, export forms and composites. Set "
    "EXPLAIN_PLUGINS='' to load no third-party plugins, or EXPLAIN_PLUGINS=a,b to load only "
    "those."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def run(args: argparse.Namespace) -> int:
    """List plugins; exit 1 if any failed to load or had methods left out."""
    from explain_core.plugin_manager import get_plugin_manager

    manager = get_plugin_manager()
    # Also when two plugins clash on a name: the listing is how the user finds the culprit.
    registry = manager.registry_without_clashes()
    infos = list(manager.plugins.values())
    contributions = _contributions(manager)
    if args.json:
        payload = [
            {
                "name": info.name,
                "version": info.version,
                "source": info.source,
                "error": info.error,
                "problems": info.problems,
                "methods": [
                    {"name": s.name, "family": s.family, "summary": s.summary}
                    for s in _specs(registry, info)
                ],
                **{kind: names for kind, names in contributions.get(info.name, {}).items()},
            }
            for info in infos
        ]
        print(json.dumps(payload, indent=2))
    else:
        for info in infos:
            print(f"{info.name} {info.version} ({info.source}) - {_status(info)}")
            for spec in _specs(registry, info):
                print(f"    {spec.name:<28} [{spec.family}] {spec.summary}")
            for kind, names in contributions.get(info.name, {}).items():
                print(f"    {kind}: {', '.join(names)}")
    return 1 if any(info.error or info.problems for info in infos) else 0


_KINDS = {
    "commands": "explain_register_commands",
    "jobs": "explain_register_jobs",
    "export forms": "explain_register_export_forms",
    "composites": "explain_register_composites",
}


def _contributions(manager: PluginManager) -> dict[str, dict[str, list[str]]]:
    """Plugin name → kind → the names it registers of commands, jobs and export forms."""
    found: dict[str, dict[str, list[str]]] = {}
    items = {
        "commands": manager.commands(),
        "jobs": manager.jobs(),
        "export forms": manager.export_forms(),
        "composites": manager.composites(),
    }
    for kind, named in items.items():
        for name in named:
            plugin = manager.owner(_KINDS[kind], name)
            found.setdefault(plugin, {}).setdefault(kind, []).append(name)
    return found


def _specs(registry: MethodRegistry, info: PluginInfo) -> list[MethodSpec]:
    # info.methods, not registry.by_plugin(info.name): a rejected twin shares the loaded
    # plugin's name but registers nothing.
    return [registry[name] for name in info.methods if name in registry]


def _status(info: PluginInfo) -> str:
    if info.error:
        return f"FAILED: {_one_line(info.error)}"
    count = len(info.methods)
    status = f"{count} method{'' if count == 1 else 's'}"
    return "; ".join([status, *(_one_line(problem) for problem in info.problems)])


def _one_line(text: str) -> str:
    return " ".join(text.split())
