"""Deletion and insertion curves (Petsiuk et al. 2018, *RISE*), built on pixel removal.

**Deletion** removes the most relevant pixels first and tracks the target class's score: a
faithful map makes it fall fast (a small area under the curve). **Insertion** starts from an input
with every pixel removed and puts the most relevant pixels back first: a faithful map makes the
score rise fast (a large area). Inserting the ``k`` most relevant pixels leaves exactly the pixels
that removing the ``N − k`` least relevant ones leaves, so the insertion curve is
:func:`~explain_core.metrics.pixel_removal.pixel_removal_curve` with ``order="least"`` over all
pixels, read backwards; ties keep that function's row-major order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from explain_core.errors import InvalidInputError
from explain_core.metrics._checks import check_int
from explain_core.metrics.pixel_removal import pixel_removal_curve, removed_pixel_counts
from explain_core.targets import TargetLike

__all__ = ["STEPS", "DeletionInsertion", "deletion_insertion"]

STEPS = 16  # the default number of steps: curves smooth enough to compare, 2 × 17 forward passes


@dataclass(frozen=True)
class DeletionInsertion:
    """Deletion and insertion curves of a batch.

    Attributes:
        removed: Fraction of pixels removed at each deletion step, ``(steps + 1,)`` from 0 to 1.
        deletion: Score per sample as the most relevant pixels are removed first,
            ``(B, steps + 1)``; column 0 is the unmodified input.
        inserted: Fraction of pixels present at each insertion step, ``(steps + 1,)`` from 0
            to 1.
        insertion: Score per sample as the most relevant pixels are put back first into the
            fully removed input, ``(B, steps + 1)``; the last column is the unmodified input.
    """

    removed: torch.Tensor
    deletion: torch.Tensor
    inserted: torch.Tensor
    insertion: torch.Tensor

    @property
    def deletion_auc(self) -> float:
        """Area under the mean deletion curve (trapezoid rule; lower is more faithful)."""
        return float(torch.trapezoid(self.deletion.double().mean(0), self.removed.double()))

    @property
    def insertion_auc(self) -> float:
        """Area under the mean insertion curve (trapezoid rule; higher is more faithful)."""
        return float(torch.trapezoid(self.insertion.double().mean(0), self.inserted.double()))


def deletion_insertion(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    attribution_maps: torch.Tensor,
    target: TargetLike,
    *,
    steps: int | None = None,
    removed_value: float = 0.0,
    probabilities: bool = True,
) -> DeletionInsertion:
    """Deletion and insertion curves of ``attribution_maps`` for ``model``.

    Args:
        model: A model in eval mode (or a function) mapping ``(B, C, H, W)`` inputs to class
            scores ``(B, classes)``.
        inputs: The inputs the maps explain, ``(B, C, H, W)``.
        attribution_maps: One spatial map per input, ``(B, H, W)`` (sum channels first, e.g.
            ``explain(...).spatial_map()``).
        target: The class whose score is tracked: one int, one per sample, or ``None`` for the
            class predicted on the unmodified input.
        steps: Number of removal (and insertion) steps over all ``H × W`` pixels; ``None``:
            :data:`STEPS`, or one pixel per step for inputs with fewer pixels.
        removed_value: Value written into every channel of a removed pixel (the background).
        probabilities: Track the softmax probability of the target class (in [0, 1], as in
            the paper); ``False`` tracks the raw score.

    Returns:
        The curves, with the fractions of pixels removed and present at each step.

    Raises:
        InvalidInputError: On bad shapes, steps or values (see
            :func:`~explain_core.metrics.pixel_removal.pixel_removal_curve`).
        ModelStateError: If ``model`` is a module with a mode-dependent layer in training mode.
    """
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
        shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise InvalidInputError(f"inputs must be a tensor of shape (B, C, H, W); got {shape}")
    pixels = inputs.shape[-2] * inputs.shape[-1]
    steps = min(STEPS, pixels) if steps is None else check_int(steps, "steps", 1)
    scores = _probabilities(model) if probabilities else model
    options = {"fraction": 1.0, "steps": steps, "removed_value": removed_value}
    deletion = pixel_removal_curve(
        scores, inputs, attribution_maps, target, order="most", **options
    )
    least_first = pixel_removal_curve(
        scores, inputs, attribution_maps, target, order="least", **options
    )
    counts = torch.tensor(removed_pixel_counts(pixels, 1.0, steps), dtype=torch.float64)
    return DeletionInsertion(
        removed=counts / pixels,
        deletion=deletion,
        inserted=(pixels - counts.flip(0)) / pixels,
        insertion=least_first.flip(1),
    )


def _probabilities(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
) -> nn.Module | Callable[[torch.Tensor], torch.Tensor]:
    """``model`` followed by a softmax over classes; a module stays a module (eval checks)."""
    if isinstance(model, nn.Module):
        return nn.Sequential(model, nn.Softmax(dim=1))
    if not callable(model):
        raise InvalidInputError(
            f"model must be a model or a function mapping inputs to scores; got "
            f"{type(model).__name__}"
        )
    return lambda x: model(x).softmax(dim=1)
