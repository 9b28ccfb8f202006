"""Pixel removal: how the target score changes as pixels are removed in attribution order.

Removing the *least* important pixels first should barely change the score of a faithful map;
removing the *most* important first should drop it quickly. A pixel is removed by setting all its
channels to ``removed_value`` (for the ``[x, 1 − x]`` encoding of CoDA-Nets, 0 in every encoded
channel, as in the paper).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from explain_core.errors import ExplainError, InvalidInputError
from explain_core.metrics._checks import check_int, check_maps, check_number
from explain_core.targets import TargetLike, normalize_target, select_target
from explain_core.validation import check_inputs, check_scores, model_error

__all__ = ["pixel_removal_curve", "removed_pixel_counts"]

Order = Literal["least", "most"]


def removed_pixel_counts(num_pixels: int, fraction: float, steps: int | None = None) -> list[int]:
    """Number of removed pixels at each step of a removal curve.

    Args:
        num_pixels: Pixels per image, ``H * W``.
        fraction: Largest fraction of pixels removed, in (0, 1].
        steps: Number of removal steps; ``None`` removes one pixel per step.

    Returns:
        ``steps + 1`` increasing counts from 0 to ``floor(fraction * num_pixels)``; step ``k``
        removes ``round(k * total / steps)`` pixels.

    Raises:
        InvalidInputError: If ``fraction`` removes no pixel or ``steps`` is not in
            ``[1, total]``.
    """
    num_pixels = check_int(num_pixels, "num_pixels", 1)
    fraction = check_number(fraction, "fraction")
    if not 0.0 < fraction <= 1.0:
        raise InvalidInputError(f"fraction must lie in (0, 1]; got fraction={fraction}.")
    total = math.floor(fraction * num_pixels + 1e-9)  # tolerate 0.3 * 10 = 2.9999999999999996
    if total < 1:
        raise InvalidInputError(
            f"fraction={fraction} of {num_pixels} pixels removes no pixel; raise the fraction."
        )
    steps = total if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= total:
        raise InvalidInputError(
            f"steps must be an int in [1, {total}] (one pixel per step at most); got {steps!r}."
        )
    return [round(k * total / steps) for k in range(steps + 1)]


@torch.no_grad()
def pixel_removal_curve(
    model_fn: Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    attribution_maps: torch.Tensor,
    target: TargetLike,
    *,
    fraction: float = 0.25,
    steps: int | None = None,
    order: Order = "least",
    removed_value: float = 0.0,
) -> torch.Tensor:
    """Target score while whole pixels are removed in the order of an attribution map.

    Pixels are ranked by their map value: ascending for ``order="least"`` (least important
    first), descending for ``"most"``. Ties keep row-major pixel order, so the result is
    deterministic. Removal is cumulative; at step ``k`` the first
    ``removed_pixel_counts(H * W, fraction, steps)[k]`` ranked pixels are set to
    ``removed_value`` in every channel.

    Args:
        model_fn: Maps a batch (B, C, H, W) to scores (B, classes), e.g. a model's logits; the
            curve reports these raw scores (no softmax or sigmoid is applied). An ``nn.Module``
            must be in eval mode; it is only read (other threads may use it meanwhile), and
            what its forward stores on itself stays, as after a plain forward.
        inputs: Inputs the model takes, finite floating point of shape (B, C, H, W).
        attribution_maps: Spatial importance per pixel, shape (B, H, W) (sum channels first).
        target: Class whose score is tracked: one int, one per sample (B,), or ``None`` for the
            class predicted for the unmodified input (the rules of :func:`explain_core.explain`).
        fraction: Largest fraction of pixels removed (0.25 in the paper).
        steps: Number of removal steps; ``None`` removes one pixel per step.
        order: ``"least"`` or ``"most"`` important pixels first.
        removed_value: Finite value written into every channel of a removed pixel.

    Returns:
        Scores of shape (B, steps + 1); column 0 is the unmodified input.

    Raises:
        InvalidInputError: On mismatched shapes, non-finite inputs, maps or ``removed_value``,
            inputs the model cannot run on, targets out of range, a bad ``order`` or bad step
            counts.
        ModelStateError: If ``model_fn`` is a module in training mode.
    """
    from explain_core.model_guard import ModelGuard, require_eval_mode

    if not callable(model_fn):
        raise InvalidInputError(
            f"model_fn must be a model or function mapping inputs to scores; got "
            f"{type(model_fn).__name__}"
        )
    if order not in ("least", "most"):
        raise InvalidInputError(f'order must be "least" or "most"; got {order!r}.')
    inputs = check_inputs(inputs, model_fn, allow_empty=True)
    if inputs.dim() != 4:
        raise InvalidInputError(f"inputs must have shape (B, C, H, W); got {tuple(inputs.shape)}.")
    batch, _, height, width = inputs.shape
    attribution_maps = check_maps(
        attribution_maps,
        "attribution_maps",
        batch,
        "Sum maps over channels first.",
    )
    if attribution_maps.shape[1:] != (height, width):
        raise InvalidInputError(
            f"attribution_maps must have shape ({batch}, {height}, {width}) to match inputs; "
            f"got {tuple(attribution_maps.shape)}. Sum maps over channels first."
        )
    removed_value = check_number(removed_value, "removed_value")
    counts = removed_pixel_counts(height * width, fraction, steps)
    target = normalize_target(target, batch, inputs.device)

    key = attribution_maps.detach().flatten(1).to(inputs.device)
    key = key if order == "least" else -key
    ranking = torch.sort(key, dim=1, stable=True).indices  # (B, H*W): pixel indices, in order
    rank = torch.empty_like(ranking)
    rank.scatter_(1, ranking, torch.arange(height * width, device=inputs.device).expand(batch, -1))

    is_module = isinstance(model_fn, nn.Module)
    if is_module:
        # Before any forward pass: training mode would update BatchNorm's running statistics.
        require_eval_mode(model_fn)
    rows = torch.arange(batch, device=inputs.device)
    scores = []
    # Plain forwards under no_grad: the guard only reads the model (a restoring one would set
    # gradients aside and write the model's state back, under other threads using it).
    with ModelGuard(model_fn) if is_module else contextlib.nullcontext():
        for step, count in enumerate(counts):
            removed = (rank < count).view(batch, 1, height, width)
            perturbed = inputs.masked_fill(removed, removed_value)
            try:
                output = model_fn(perturbed)
            except ExplainError:
                raise
            except (RuntimeError, ValueError, TypeError, IndexError) as error:
                if step > 0:
                    raise  # it ran on the inputs: a failure on a perturbed batch is its own
                raise model_error(model_fn, inputs, error) from error
            output = check_scores(output, batch)
            if step == 0:
                # The unmodified input fixes the predicted class (target=None); range check.
                target = select_target(output, target)
            scores.append(output[rows, target])
    return torch.stack(scores, dim=1)
