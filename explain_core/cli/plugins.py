"""``explain plugins``: the loaded plugins, their versions and what each registers."""

from __future__ import annotations

import argparse
import json

NAME = "plugins"
HELP = "list plugins, versions and the methods they register"
DESCRIPTION = (
    "List the loaded plugins (built-in and installed through the 'explain.plugins' entry-point "
    "group), their versions and methods. Set EXPLAIN_PLUGINS='' to load no third-party plugins, "
    "or EXPLAIN_PLUGINS=a,b to load only those."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def run(args: argparse.Namespace) -> int:
    """List plugins; exit 1 if any failed to load."""
    from explain_core.plugin_manager import get_plugin_manager

    manager = get_plugin_manager()
    registry = manager.registry
    infos = list(manager.plugins.values())
    if args.json:
        payload = [
            {
                "name": info.name,
                "version": info.version,
                "source": info.source,
                "error": info.error,
                "methods": [
                    {"name": s.name, "family": s.family, "summary": s.summary}
                    for s in registry.by_plugin(info.name)
                ],
            }
            for info in infos
        ]
        print(json.dumps(payload, indent=2))
    else:
        for info in infos:
            count = len(info.methods)
            status = (
                f"FAILED: {info.error}"
                if info.error
                else f"{count} method{'' if count == 1 else 's'}"
            )
            print(f"{info.name} {info.version} ({info.source}) - {status}")
            for spec in registry.by_plugin(info.name):
                print(f"    {spec.name:<28} [{spec.family}] {spec.summary}")
    return 1 if any(info.error for info in infos) else 0
