"""The ONNX exporter as a built-in plugin: its command, demo step, export forms and adapters.

Registered like every plugin, through an entry point of the ``explain.plugins`` group and the
hooks of :mod:`explain_core.hookspecs`. Importing it needs no ONNX package: the ``onnx`` extra is
imported by the features that use it.
"""

from __future__ import annotations

from explain_core.cli.command import Command
from explain_core.demo import DemoStep
from explain_core.export_forms import ExportAdapter, ExportForm
from explain_core.hookspecs import hookimpl


@hookimpl
def explain_register_commands() -> list[Command]:
    """``explain export``."""
    from explain_onnx import cli

    return [Command.from_module(cli)]


@hookimpl
def explain_demo_steps() -> list[DemoStep]:
    """The demo's ONNX section."""
    from explain_onnx.demo import OnnxDemoStep

    return [OnnxDemoStep()]


@hookimpl
def explain_register_export_forms() -> list[ExportForm]:
    """CoDA contributions, capsule saliency, Input×Gradient and the one-composite LRP methods."""
    from explain_onnx.explained import BUILTIN_FORMS, lrp_forms

    return [*BUILTIN_FORMS, *lrp_forms()]


@hookimpl
def explain_register_export_adapters() -> list[ExportAdapter]:
    """Exportable forms of CoDA-Nets and capsule networks (no data-dependent checks)."""
    from explain_capsules import DRCapsNet, MultiLayerCapsNet
    from explain_coda import CoDANet
    from explain_onnx.adapters import CapsuleGraph, CoDAGraph

    return [
        ExportAdapter(CoDANet, CoDAGraph),
        ExportAdapter(DRCapsNet, CapsuleGraph),
        ExportAdapter(MultiLayerCapsNet, CapsuleGraph),
    ]
