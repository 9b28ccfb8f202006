"""Canonizers shared by relevance methods."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from explain_core.errors import ModelStateError
from explain_core.interfaces.relevance import Canonizer

_LINEAR_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class SequentialMergeBatchNorm(Canonizer):
    """Fold each BatchNorm that directly follows a Linear/Conv in an ``nn.Sequential``.

    In eval mode ``BN(Wx + b) = (s·W)x + s·(b − μ) + β`` with ``s = γ/√(σ² + ε)``, so the pair is
    one affine layer. During the canonizer's lifetime the linear layer holds the folded
    parameters (new ``Parameter`` objects) and the BatchNorm is replaced by ``nn.Identity``;
    restoring puts the original objects back, so the model is bit-identical afterwards.
    Only adjacent pairs inside a ``Sequential`` are folded, where the linear layer's output is
    certain to feed nothing but the BatchNorm.
    """

    def apply(self, model: nn.Module) -> Callable[[], None]:
        """Fold all adjacent pairs and return the function that unfolds them."""
        undo: list[Callable[[], None]] = []
        try:
            for container in model.modules():
                if isinstance(container, nn.Sequential):
                    undo.extend(_fold_pairs(container))
        except Exception:
            _run_reversed(undo)
            raise
        return lambda: _run_reversed(undo)


def _run_reversed(undo: list[Callable[[], None]]) -> None:
    for step in reversed(undo):
        step()


def _fold_pairs(container: nn.Sequential) -> list[Callable[[], None]]:
    undo: list[Callable[[], None]] = []
    names = list(container._modules)
    for first, second in itertools.pairwise(names):
        linear, norm = container._modules[first], container._modules[second]
        if isinstance(linear, _LINEAR_TYPES) and isinstance(norm, _NORM_TYPES):
            undo.append(_fold(container, linear, second, norm))
    return undo


def _fold(
    container: nn.Sequential,
    linear: nn.Module,
    norm_name: str,
    norm: nn.modules.batchnorm._BatchNorm,
) -> Callable[[], None]:
    if norm.training or norm.running_mean is None or norm.running_var is None:
        raise ModelStateError(
            f"cannot fold {type(norm).__name__} {norm_name!r}: it needs eval mode and running "
            "statistics (track_running_stats=True); call model.eval() first"
        )
    with torch.no_grad():
        scale = torch.rsqrt(norm.running_var + norm.eps)
        if norm.weight is not None:
            scale = scale * norm.weight
        shift = -norm.running_mean * scale
        if norm.bias is not None:
            shift = shift + norm.bias
        weight = linear.weight * scale.reshape(-1, *([1] * (linear.weight.dim() - 1)))
        bias = shift if linear.bias is None else linear.bias * scale + shift
    saved_weight, saved_bias = linear._parameters["weight"], linear._parameters["bias"]
    linear._parameters["weight"] = nn.Parameter(weight, saved_weight.requires_grad)
    linear._parameters["bias"] = nn.Parameter(bias, saved_weight.requires_grad)
    container._modules[norm_name] = nn.Identity()

    def restore() -> None:
        linear._parameters["weight"] = saved_weight
        linear._parameters["bias"] = saved_bias
        container._modules[norm_name] = norm

    return restore
