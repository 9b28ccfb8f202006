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

    Returns:
        Method specifications; each name must be unique across all loaded plugins.
    """


@hookspec
def explain_demo_steps() -> Sequence[DemoStep]:
    """Return the steps this plugin contributes to ``explain demo``.

    Returns:
        Demo steps, run in the order of their ``order`` attribute.
    """
