"""The core's own plugin: its subcommands, evaluation jobs and demo step.

Registered by the plugin manager before any other plugin, through the same hooks as every plugin
(:mod:`explain_core.hookspecs`), so the core's extensions and a third party's are one kind of
thing.
"""

from __future__ import annotations

from explain_core.cli import attribute, check, demo, evaluate, plugins
from explain_core.cli.command import Command
from explain_core.demo import DemoStep
from explain_core.distributed.jobs import CORE_JOBS, Job
from explain_core.hookspecs import hookimpl


@hookimpl
def explain_register_commands() -> list[Command]:
    """``plugins``, ``demo``, ``attribute``, ``check`` and ``evaluate``."""
    return [Command.from_module(module) for module in (plugins, demo, attribute, check, evaluate)]


@hookimpl
def explain_register_jobs() -> list[Job]:
    """``attributions``, ``localisation``, ``pixel-removal`` and ``csc``."""
    return list(CORE_JOBS)


@hookimpl
def explain_demo_steps() -> list[DemoStep]:
    """The bundled data sets, shown first."""
    from explain_core.data.showcase import BundledDataStep

    return [BundledDataStep()]
