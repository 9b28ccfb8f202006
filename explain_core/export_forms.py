"""What exporters export: models (through adapters) and models with their explanations.

Plugins register both through hooks (``explain_register_export_forms``,
``explain_register_export_adapters``); an exporter plugin collects them from the plugin manager
(:meth:`~explain_core.plugin_manager.PluginManager.export_forms`). Nothing here depends on a
format: an explained form is a plain ``nn.Module`` of exportable operations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ExportAdapter", "ExportForm"]


@dataclass(frozen=True)
class ExportForm:
    """A method a model can be exported with: one graph returning ``(logits, explanation)``.

    Attributes:
        name: Method name, as in ``explain(model, x, name)``.
        build: ``build(model, example, target_input, **options) -> nn.Module`` computing
            ``(logits, explanation)`` from ``x`` (and, with ``target_input``, the class to
            explain, int64 ``(batch,)``; otherwise the predicted class) with exportable
            operations only.
        reference: ``reference(model, x, target, **options) -> (logits, explanation)``: the same
            computed by the library's eager method (``target`` int64 ``(batch,)`` or ``None``),
            what parity checks compare the export with.
        description: One line for listings.
    """

    name: str
    build: Callable[..., nn.Module]
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    description: str = ""


@dataclass(frozen=True)
class ExportAdapter:
    """The exportable form of a model type: the same arithmetic without data-dependent checks.

    Attributes:
        model_type: Models of exactly this type (a subclass may have changed ``forward``).
        build: ``build(model) -> nn.Module`` computing the model's outputs from its own
            submodules and parameters.
    """

    model_type: type
    build: Callable[[nn.Module], nn.Module]

    @property
    def name(self) -> str:
        """The model type's qualified name (adapters are unique per type)."""
        return f"{self.model_type.__module__}.{self.model_type.__qualname__}"
