"""Random-logit test (Sixt et al. 2020, Fig. 4a): does the map change with the explained class?

Each sample is explained once for its true class and once for a random other class; the two maps
are compared by SSIM (:func:`~explain_core.metrics.randomisation.map_ssim`). A method that
ignores the explained output scores 1; class-sensitive methods score clearly lower.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from explain_core.metrics.randomisation import map_ssim

__all__ = ["RandomLogitResult", "method_maps", "random_logit_ssim", "to_maps"]

MapFunction = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def to_maps(attribution: torch.Tensor) -> torch.Tensor:
    """``(N, H, W)`` maps: channels of ``(N, C, H, W)`` summed, ``(N, H, W)`` kept."""
    if attribution.dim() == 4:
        return attribution.sum(dim=1)
    if attribution.dim() == 3:
        return attribution
    raise ValueError(
        f"attribution maps need shape (N, C, H, W) or (N, H, W); got {tuple(attribution.shape)}"
    )


def method_maps(method: str, *, baselines: Any = None, **options: Any) -> MapFunction:
    """A ``maps(model, inputs, targets) -> (N, H, W)`` function for a registered method."""

    def maps(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from explain_core.api import explain

        result = explain(model, inputs, method, targets, baselines=baselines, **options)
        return to_maps(result.attribution.detach())

    return maps


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
    targets: torch.Tensor,
    *,
    n_classes: int | None = None,
    seed: int = 0,
    absolute_sign: bool = False,
    **options: Any,
) -> RandomLogitResult:
    """Per-sample SSIM between the map of ``targets`` and that of a random other class.

    Args:
        model: The model in eval mode.
        maps: ``maps(model, inputs, targets) -> (N, H, W)``, or a registered method name
            (``options`` go to the method).
        inputs: Samples.
        targets: True (or explained) class per sample, int64 ``(N,)``.
        n_classes: Number of outputs (default: read from one forward pass).
        seed: Seed of the random classes.
        absolute_sign: ``max(SSIM(s), SSIM(−s))`` (see :func:`map_ssim`).
        **options: Options of the method when ``maps`` is a name.
    """
    if isinstance(maps, str):
        maps = method_maps(maps, **options)
    elif options:
        raise ValueError("options only apply to a method given by name")
    targets = torch.as_tensor(targets, dtype=torch.long, device=inputs.device)
    if n_classes is None:
        with torch.no_grad():
            n_classes = int(model(inputs[:1]).shape[1])
    if n_classes < 2:
        raise ValueError("the random-logit test needs at least two outputs")
    generator = torch.Generator().manual_seed(seed)
    shift = torch.randint(1, n_classes, (len(targets),), generator=generator).to(targets.device)
    others = (targets + shift) % n_classes  # uniform over the other classes
    original = maps(model, inputs, targets)
    randomised = maps(model, inputs, others)
    return RandomLogitResult(map_ssim(original, randomised, absolute_sign=absolute_sign), others)
