"""The hooks a plugin implements. Built-in and third-party plugins use exactly these.

A plugin is a module (or object) with functions decorated by :data:`hookimpl`, registered through
the ``explain.plugins`` entry-point group::

    [project.entry-points."explain.plugins"]
    my_plugin = "my_package.plugin"

The built-in plugins are entry points of this group too, declared by the ``explain-torch``
distribution; the core's own commands and jobs are registered by its internal plugin
(:mod:`explain_core.builtin`) through the same hooks. Every hook returns a list; a plugin whose
hook raises or returns anything else fails alone, with a ``PluginWarning``. Names (methods,
commands, jobs, export forms) are unique: a built-in keeps its name against a third-party plugin,
and of two third-party plugins the first loaded keeps it (the other is warned about).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from explain_core.cli.command import Command
    from explain_core.demo import DemoStep
    from explain_core.distributed.jobs import Job
    from explain_core.export_forms import ExportAdapter, ExportForm
    from explain_core.interfaces.relevance import CompositeSpec
    from explain_core.registry import MethodSpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "explain_demo_steps",
    "explain_register_commands",
    "explain_register_export_adapters",
    "explain_register_export_forms",
    "explain_register_jobs",
    "explain_register_methods",
    "hookimpl",
    "hookspec",
]

PROJECT_NAME = "explain"
ENTRY_POINT_GROUP = "explain.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def explain_register_methods() -> Sequence[MethodSpec]:
    """Return the attribution methods this plugin provides.

    A plugin whose result is not a list of ``MethodSpec`` (with a non-empty ``str`` name, a
    callable factory and ``str`` family and summary), or that registers a name twice, is
    reported with a ``PluginWarning`` and not used; the other plugins keep working.

    Returns:
        Method specifications; each name must be unique across all loaded plugins. A name that a
        built-in plugin registers stays the built-in's (the plugin's method is left out, with a
        warning); two third-party plugins registering one name are an error naming both.
    """


@hookspec
def explain_demo_steps() -> Sequence[DemoStep]:
    """Return the steps this plugin contributes to ``explain demo``.

    A plugin whose result is not a list of ``DemoStep`` objects is reported with a
    ``PluginWarning`` and not used.

    Returns:
        Demo steps, run in the order of their ``order`` attribute.
    """


@hookspec
def explain_register_commands() -> Sequence[Command]:
    """Return subcommands of the ``explain`` command line.

    Returns:
        :class:`~explain_core.cli.command.Command` objects: a name, help texts, a function
        adding the subcommand's arguments to its ``argparse`` parser, and the function running
        it (returning the exit status).
    """


@hookspec
def explain_register_jobs() -> Sequence[Job]:
    """Return evaluation jobs for ``explain evaluate`` (and ``explain_core.distributed``).

    Returns:
        :class:`~explain_core.distributed.jobs.Job` objects: per-chunk computation on every
        rank, an exact merge of all chunks, and their own command-line options.
    """


@hookspec
def explain_register_export_forms() -> Sequence[ExportForm]:
    """Return explained-export forms: methods a model can be exported with.

    Returns:
        :class:`~explain_core.export_forms.ExportForm` objects: for a method name, a function
        building a module ``(x[, target]) -> (logits, explanation)`` of exportable operations,
        and the eager reference that parity checks compare it with.
    """


@hookspec
def explain_register_export_adapters() -> Sequence[ExportAdapter]:
    """Return export adapters: the exportable form of a model type.

    Returns:
        :class:`~explain_core.export_forms.ExportAdapter` objects: a model type (matched
        exactly) and a function returning the module to export in its place.
    """


@hookspec
def explain_register_composites() -> Sequence[CompositeSpec]:
    """Return composites by name, for the attributors that take gradients (``composite=``).

    Returns:
        :class:`~explain_core.interfaces.relevance.CompositeSpec` objects: a name and a function
        building the :class:`~explain_core.interfaces.relevance.ModifiedGradient`.
    """
