"""Turning the many ways users name targets into one int64 tensor per batch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from explain_core.errors import InvalidInputError
from explain_core.validation import check_scores

__all__ = [
    "TargetLike",
    "normalize_target",
    "select_target",
]

TargetLike = int | Sequence[int] | np.ndarray | torch.Tensor | None


def normalize_target(target: TargetLike, batch: int, device: torch.device) -> torch.Tensor | None:
    """Return ``target`` as int64 ``(batch,)``, or ``None`` for "the predicted class".

    Args:
        target: ``None``, one int for every sample, or one int per sample.
        batch: Number of samples.
        device: Device of the returned tensor.

    Raises:
        InvalidInputError: If the target is not integral (a string, say), is empty or has the
            wrong length.
    """
    if target is None:
        return None
    if isinstance(target, (bool, float, str, bytes)):
        raise _target_form_error(target)
    try:
        tensor = torch.as_tensor(target if isinstance(target, torch.Tensor) else np.asarray(target))
    except (TypeError, ValueError, RuntimeError) as error:  # strings, ragged lists, objects
        raise _target_form_error(target) from error
    if tensor.numel() == 0:
        # Checked before the dtype: NumPy makes an empty list float64, which is not the problem.
        if batch == 0:
            return torch.empty(0, dtype=torch.long, device=device)
        raise InvalidInputError(
            f"target is empty ({_short_repr(target)}); give one int for all samples, one int per "
            f"sample ({batch}), or None for the predicted class"
        )
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise InvalidInputError(f"target must hold integers; got dtype {tensor.dtype}")
    tensor = tensor.to(device=device, dtype=torch.long).reshape(-1)
    if tensor.numel() == 1:
        return tensor.expand(batch).clone()
    if tensor.numel() != batch:
        message = (
            f"target must be one int or one int per sample ({batch}); got {tensor.numel()} values"
        )
        if isinstance(target, tuple) or (
            isinstance(target, list) and any(isinstance(item, tuple) for item in target)
        ):
            message += (
                ". A tuple that indexes an output with more axes after the batch (a class and a "
                "pixel of a segmentation map) is Captum's convention, which "
                "Explainer(model, method).attribute(x, target=(c, i, j)) takes"
            )
        raise InvalidInputError(message)
    return tensor.clone()  # never the caller's tensor (or an inference tensor) itself


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _target_form_error(target: object) -> InvalidInputError:
    text = _short_repr(target)
    return InvalidInputError(
        f"target must be None (the predicted class), an int, or one int per sample (a list, NumPy "
        f"array or integer tensor); got {text} ({type(target).__name__}), so convert it, e.g. "
        "target=int(label)"
    )


def select_target(output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """The explained index per sample: ``target``, or the arg-max of ``output`` if ``None``.

    Raises:
        InvalidInputError: If ``output`` is not one ``(batch, n_outputs)`` tensor or a target is
            out of range.
    """
    check_scores(output)
    if target is None:
        return output.detach().argmax(dim=1)
    n_outputs = output.shape[1]
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= n_outputs):
        raise InvalidInputError(
            f"target must lie in [0, {n_outputs - 1}] for a model with {n_outputs} outputs; "
            f"got values from {int(target.min())} to {int(target.max())}"
        )
    return target
