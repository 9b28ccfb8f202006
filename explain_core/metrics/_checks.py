"""Argument checks shared by the metrics, so that they all refuse bad input in the same words.

Every check raises :class:`~explain_core.errors.InvalidInputError` saying what was got, what was
expected and what to do, before any work (and before any forward pass on the user's model).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch
from torch import nn

from explain_core.errors import InvalidInputError
from explain_core.targets import select_target


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


def check_inputs(
    inputs: Any, model: object = None, *, name: str = "inputs", allow_empty: bool = False
) -> torch.Tensor:
    """Detached ``inputs`` if they are a finite floating-point batch that fits ``model``.

    Args:
        inputs: The model inputs, ``(batch, ...)``.
        model: The model they are fed to; device and dtype are compared only for an
            ``nn.Module`` (plain callables are taken as they are).
        name: Argument name used in messages.
        allow_empty: Accept a batch of zero samples.

    Raises:
        InvalidInputError: If ``inputs`` is not such a tensor.
    """
    if not isinstance(inputs, torch.Tensor):
        raise InvalidInputError(
            f"{name} must be a torch.Tensor of shape (batch, ...); got {type(inputs).__name__}. "
            "Convert NumPy arrays with torch.from_numpy(array).float()"
        )
    if inputs.dim() < 2:
        raise InvalidInputError(
            f"{name} need a batch axis: shape (batch, ...); got {tuple(inputs.shape)}. "
            f"Use {name}[None] for a single sample."
        )
    if not inputs.is_floating_point():
        raise InvalidInputError(
            f"{name} must be floating point; got dtype {inputs.dtype}. Use {name}.float()."
        )
    if inputs.shape[0] == 0 and not allow_empty:
        raise InvalidInputError(
            f"{name} hold no samples (shape {tuple(inputs.shape)}); pass at least one sample"
        )
    if inputs.device.type == "meta":
        raise InvalidInputError(
            f"{name} are meta tensors, which hold no values; pass real data on the model's device"
        )
    if isinstance(model, nn.Module):
        parameters = list(model.parameters())
        if parameters and parameters[0].device.type == "meta":
            raise InvalidInputError(
                "the model's parameters are on the meta device and hold no values; materialise "
                "them first, e.g. model.to_empty(device='cpu') and then model.load_state_dict(...)"
            )
        if parameters and inputs.device != parameters[0].device:
            raise InvalidInputError(
                f"{name} are on {inputs.device} but the model is on {parameters[0].device}; "
                "move one of them"
            )
        dtypes = {p.dtype for p in parameters if p.is_floating_point()}
        # Only a model of one dtype says unambiguously what its inputs must be.
        if len(dtypes) == 1 and inputs.dtype not in dtypes:
            (dtype,) = dtypes
            raise InvalidInputError(
                f"{name} have dtype {inputs.dtype} but the model's parameters are {dtype}; "
                f"convert the inputs (e.g. {name}.to({dtype})) or the model"
            )
    if not bool(torch.isfinite(inputs).all()):
        raise InvalidInputError(f"{name} contain NaN or infinite values; pass finite values")
    return inputs.detach()


def check_maps(
    maps: Any, name: str, batch: int | None = None, hint: str = "Sum maps over channels first."
) -> torch.Tensor:
    """``maps`` as a tensor if they are finite ``(N, H, W)`` maps (``N == batch`` if given).

    Raises:
        InvalidInputError: If ``maps`` is not a tensor or array of that shape, or not finite.
    """
    maps = as_tensor(maps, name)
    expected = f"({'N' if batch is None else batch}, H, W)"
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


def check_scores(output: Any, batch: int) -> torch.Tensor:
    """``output`` if it is a ``(batch, n_outputs)`` tensor of scores.

    Raises:
        InvalidInputError: If the model returned anything else.
    """
    if isinstance(output, torch.Tensor) and output.dim() == 2 and output.shape[0] == batch:
        return output
    got = f"shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else "a "
    got += "" if isinstance(output, torch.Tensor) else type(output).__name__
    raise InvalidInputError(
        f"the model must return one tensor of scores of shape ({batch}, n_outputs); got {got}. "
        "Wrap it so that it returns one score per class, e.g. model(x)[0] for a tuple."
    )


def check_target_range(target: torch.Tensor, n_outputs: int) -> None:
    """Refuse targets outside ``[0, n_outputs)``, by the rule explain() uses.

    Raises:
        InvalidInputError: If a target is out of range.
    """
    # select_target reads only the number of outputs from the scores, so empty scores suffice.
    select_target(torch.empty(0, n_outputs), target)


def check_maps_result(maps: Any, batch: int) -> torch.Tensor:
    """The result of a user's ``maps(model, inputs, targets)`` function, checked like maps."""
    return check_maps(
        maps,
        "the maps function's result",
        batch,
        "Return one (H, W) map per sample, e.g. to_maps(attribution).",
    )
