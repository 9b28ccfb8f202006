"""Random-logit test (Sixt et al. 2020, Fig. 4a): does the map change with the explained class?

Each sample is explained once for its true class and once for a random other class; the two maps
are compared by SSIM (:func:`~explain_core.metrics.randomisation.map_ssim`). A method that
ignores the explained output scores 1; class-sensitive methods score clearly lower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from explain_core.errors import ExplainError, InvalidInputError
from explain_core.metrics._checks import (
    check_int,
    check_maps_result,
    check_target_range,
    input_layout,
    required_targets,
)
from explain_core.metrics.maps import MapFunction, resolve_maps
from explain_core.metrics.randomisation import compare_maps
from explain_core.targets import TargetLike
from explain_core.validation import check_inputs, check_scores, model_error

__all__ = ["RandomLogitResult", "random_logit_ssim"]


@dataclass(frozen=True)
class RandomLogitResult:
    """SSIM between maps of the true and of a random other class.

    Attributes:
        ssim: Per-sample SSIM, shape ``(N,)``.
        random_targets: The random other class per sample.
    """

    ssim: np.ndarray
    random_targets: torch.Tensor

    @property
    def mean_ssim(self) -> float:
        """Mean SSIM over samples."""
        return float(self.ssim.mean())


def random_logit_ssim(
    model: nn.Module,
    maps: MapFunction | str,
    inputs: torch.Tensor,
    targets: TargetLike,
    *,
    n_classes: int | None = None,
    seed: int = 0,
    absolute_sign: bool = False,
    **options: Any,
) -> RandomLogitResult:
    """Per-sample SSIM between the map of ``targets`` and that of a random other class.

    Image inputs ``(N, C, H, W)`` are compared as ``(N, H, W)`` maps by :func:`map_ssim`;
    signal inputs ``(N, C, L)`` as ``(N, C, L)`` maps by :func:`signal_ssim`.

    Args:
        model: The model in eval mode (left unchanged).
        maps: ``maps(model, inputs, targets) -> (N, H, W)`` (``(N, C, L)`` for signal inputs),
            or a registered method name (``options`` go to the method).
        inputs: Samples ``(N, ...)``, finite floating point.
        targets: True (or explained) class per sample: one int for all, or one int per sample.
        n_classes: Draw the other class from the first ``n_classes`` outputs (default: all of
            the model's outputs); at most the model's number of outputs.
        seed: Seed of the random classes.
        absolute_sign: ``max(SSIM(s), SSIM(−s))`` (see :func:`map_ssim`).
        **options: Options of the method when ``maps`` is a name.

    Raises:
        InvalidInputError: For inputs, targets, ``n_classes``, options or maps that do not fit
            (e.g. a maps function returning other than finite ``(N, H, W)`` maps), inputs the
            model cannot run on, or a method name inside ``torch.inference_mode()``.
        ModelStateError: If the model is in training mode.
    """
    from explain_core.model_guard import require_eval_mode

    maps = resolve_maps(maps, options, "random_logit_ssim()")
    inputs = check_inputs(inputs, model)
    layout = input_layout(inputs)
    targets = required_targets(targets, inputs)
    seed = check_int(seed, "seed", 0)
    if n_classes is not None:
        n_classes = check_int(n_classes, "n_classes", 2)  # the other class needs a second output
    # Check the mode before any forward pass: in training mode it would update BatchNorm's
    # running statistics of the user's model.
    require_eval_mode(model)
    n_outputs = _n_outputs(model, inputs)
    if n_classes is None:
        if n_outputs < 2:
            raise InvalidInputError(
                f"the random-logit test needs a model with at least two outputs (the explained "
                f"class and another); this one has {n_outputs}"
            )
        n_classes = n_outputs
    elif n_classes > n_outputs:
        raise InvalidInputError(
            f"n_classes={n_classes} but the model has {n_outputs} outputs; give at most "
            f"n_classes={n_outputs}, or leave n_classes=None to draw from all of them"
        )
    check_target_range(targets, n_classes)
    generator = torch.Generator().manual_seed(seed)
    shift = torch.randint(1, n_classes, (len(targets),), generator=generator).to(targets.device)
    others = (targets + shift) % n_classes  # uniform over the other classes
    original = check_maps_result(maps(model, inputs, targets), len(targets), layout)
    randomised = check_maps_result(maps(model, inputs, others), len(targets), layout)
    similarity = compare_maps(original, randomised, layout, absolute_sign=absolute_sign)
    return RandomLogitResult(similarity, others)


def _n_outputs(model: nn.Module, inputs: torch.Tensor) -> int:
    """The model's number of outputs, from one sample; a clear error if it cannot run on it."""
    from explain_core.model_guard import ModelGuard

    with ModelGuard(model), torch.no_grad():  # reads only: other threads may use the model
        try:
            output = model(inputs[:1])
        except ExplainError:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            raise model_error(model, inputs, error) from error
        return check_scores(output, 1).shape[1]
