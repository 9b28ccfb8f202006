"""Argument checks shared by the metrics, so that they all refuse bad input in the same words.

Every check raises :class:`~explain_core.errors.InvalidInputError` saying what was got, what was
expected and what to do, before any work (and before any forward pass on the user's model).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal

import numpy as np
import torch

from explain_core.errors import InvalidInputError
from explain_core.targets import normalize_target, select_target


def check_int(value: Any, name: str, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidInputError(f"{name} must be an int >= {minimum}; got {name}={value!r}")
    return int(value)


def check_number(value: Any, name: str) -> float:
    """``value`` as a float if it is a finite real number (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
    ):
        raise InvalidInputError(f"{name} must be a finite number; got {name}={value!r}")
    return float(value)


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """``value`` as a tensor: tensors as they are, NumPy arrays converted (sharing memory)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(
            f"{name} must be a torch.Tensor or a NumPy array; got {type(value).__name__}"
        )
    return value


Layout = Literal["image", "signal"]


def input_layout(inputs: torch.Tensor) -> Layout:
    """How the map metrics compare maps of ``inputs``: 3-d ``(N, C, L)`` inputs are signals.

    torch's layout for 1-d signals (``Conv1d``) is ``(N, C, L)``; SSIM of such maps as if they
    were ``C × L`` images would mix channels as a spatial axis, so they are compared along
    ``L`` per channel instead. Everything else is compared as ``(N, H, W)`` image maps.
    """
    return "signal" if inputs.dim() == 3 else "image"


def check_maps(
    maps: Any,
    name: str,
    batch: int | None = None,
    hint: str = "Sum maps over channels first.",
    layout: Layout = "image",
) -> torch.Tensor:
    """``maps`` as a tensor if they are finite maps of ``layout`` (``N == batch`` if given).

    Image maps are ``(N, H, W)``; signal maps ``(N, C, L)``, with ``(N, L)`` taken as one
    channel.

    Raises:
        InvalidInputError: If ``maps`` is not a tensor or array of that shape, or not finite.
    """
    maps = as_tensor(maps, name)
    n = "N" if batch is None else batch
    if layout == "signal" and maps.dim() == 2:
        maps = maps[:, None]
    expected = f"({n}, C, L)" if layout == "signal" else f"({n}, H, W)"
    if maps.dim() != 3 or (batch is not None and maps.shape[0] != batch):
        raise InvalidInputError(
            f"{name} must have shape {expected}; got {tuple(maps.shape)}. {hint}"
        )
    if maps.is_complex() or maps.dtype == torch.bool:
        raise InvalidInputError(f"{name} must hold real numbers; got dtype {maps.dtype}")
    if not bool(torch.isfinite(maps).all()):
        raise InvalidInputError(
            f"{name} must be finite; got NaN or infinite values. Check the method and inputs "
            "that produced them."
        )
    return maps


def check_target_range(target: torch.Tensor, n_outputs: int) -> None:
    """Refuse targets outside ``[0, n_outputs)``, by the rule explain() uses.

    Raises:
        InvalidInputError: If a target is out of range.
    """
    # select_target reads only the number of outputs from the scores, so empty scores suffice.
    select_target(torch.empty(0, n_outputs), target)


def check_maps_result(maps: Any, batch: int, layout: Layout = "image") -> torch.Tensor:
    """The result of a user's ``maps(model, inputs, targets)`` function, checked like maps."""
    hint = (
        "For (N, C, L) signal inputs return one (C, L) map per sample, e.g. the attribution."
        if layout == "signal"
        else "Return one (H, W) map per sample, e.g. to_maps(attribution)."
    )
    return check_maps(maps, "the maps function's result", batch, hint, layout)


def required_targets(targets: Any, inputs: torch.Tensor) -> torch.Tensor:
    """``targets`` as one class per sample; ``None`` (the predicted class) is refused."""
    if targets is None:
        raise InvalidInputError(
            "targets must be given: one int for all samples or one int per sample"
        )
    return normalize_target(targets, inputs.shape[0], inputs.device)


def check_options(maps: Any, options: dict[str, Any]) -> None:
    """Refuse method options next to a maps function, which takes none."""
    if options and not isinstance(maps, str):
        raise InvalidInputError(
            f"options ({', '.join(sorted(options))}) only apply to a method given by name; "
            "a maps function must set its method's options itself"
        )
