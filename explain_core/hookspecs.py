"""The hooks a plugin implements. Built-in and third-party plugins use exactly these.

A plugin is a module (or object) with functions decorated by :data:`hookimpl`, registered through
the ``explain.plugins`` entry-point group::

    [project.entry-points."explain.plugins"]
    my_plugin = "my_package.plugin"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from explain_core.demo import DemoStep
    from explain_core.registry import MethodSpec

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
