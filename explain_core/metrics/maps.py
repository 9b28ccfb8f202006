"""Attribution maps for the map metrics: from a registered method, or a function of yours."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from explain_core.api import explain
from explain_core.errors import InvalidInputError
from explain_core.metrics._checks import as_tensor, check_options
from explain_core.plugin_manager import get_registry
from explain_core.validation import refuse_inference_mode

__all__ = ["MapFunction", "method_maps", "resolve_maps", "to_maps"]

MapFunction = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def to_maps(attribution: torch.Tensor) -> torch.Tensor:
    """Maps for the SSIM metrics: channels of ``(N, C, H, W)`` summed, 3-d maps kept.

    A 3-d attribution is an ``(N, H, W)`` map or the ``(N, C, L)`` attribution of signal
    inputs, which the metrics compare per channel (see :func:`signal_ssim`).

    Raises:
        InvalidInputError: If ``attribution`` is not a 3-d or 4-d tensor (or NumPy array).
    """
    attribution = as_tensor(attribution, "attribution")
    if attribution.dim() == 4:
        return attribution.sum(dim=1)
    if attribution.dim() == 3:
        return attribution
    raise InvalidInputError(
        f"attribution maps need shape (N, C, H, W) or (N, H, W), or (N, C, L) for signals; got "
        f"{tuple(attribution.shape)}. The map metrics compare image maps and 1-d signals: use "
        "them with image or signal inputs, not flat (N, features) vectors."
    )


def resolve_maps(maps: str | MapFunction, options: dict[str, Any], caller: str) -> MapFunction:
    """The function a metric's ``maps`` argument names: a method (with ``options``) or itself.

    Raises:
        InvalidInputError: For options next to a function, anything else than a name or a
            function, or a method name inside ``torch.inference_mode()`` (``caller`` names the
            metric).
    """
    check_options(maps, options)
    if isinstance(maps, str):
        refuse_inference_mode(caller)
        return method_maps(maps, **options)
    if not callable(maps):
        raise InvalidInputError(
            "maps must be a method name or a function maps(model, inputs, targets) -> (N, H, W); "
            f"got {type(maps).__name__}"
        )
    return maps


def method_maps(method: str, *, baselines: Any = None, **options: Any) -> MapFunction:
    """A ``maps(model, inputs, targets)`` function for a registered method (see :func:`to_maps`).

    Raises:
        UnknownMethodError: If no plugin registers ``method``.
        InvalidInputError: If an option does not fit the method (checked here, before any work).
    """
    get_registry()[method].create(**options)  # fail early on unknown names and options

    def maps(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        result = explain(model, inputs, method, targets, baselines=baselines, **options)
        return to_maps(result.attribution.detach())

    return maps
