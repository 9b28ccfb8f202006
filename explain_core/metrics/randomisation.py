"""Cascading parameter randomisation (Adebayo et al., 2018): do maps depend on the weights?

Layers are re-initialised from the output backwards, one more at a time, on a *copy* of the
model; after each step the attribution maps are compared with the original ones by SSIM. Maps
that stay similar while the network is destroyed cannot reflect what the network learnt.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from explain_core.errors import InvalidInputError
from explain_core.metrics._checks import check_int, check_maps, check_maps_result
from explain_core.targets import TargetLike, normalize_target
from explain_core.validation import check_inputs

MapFunction = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RandomisationStep:
    """Similarity after re-initialising ``layers`` (output side first).

    Attributes:
        layers: Names of all layers re-initialised so far.
        ssim: Per-sample SSIM between original and randomised maps, shape ``(N,)``.
    """

    layers: tuple[str, ...]
    ssim: np.ndarray

    @property
    def mean_ssim(self) -> float:
        """Mean SSIM over samples."""
        return float(self.ssim.mean())


# SSIM's window is 7×7 (skimage's default), or the largest odd size that fits smaller maps. A
# 1×1 window has no variance to compare, so maps need at least 3×3 pixels.
SSIM_WINDOW = 7
MIN_SSIM_SIZE = 3


def map_ssim(
    first: torch.Tensor, second: torch.Tensor, *, absolute_sign: bool = False
) -> np.ndarray:
    """Per-sample SSIM of two batches of ``(N, H, W)`` maps, each normalised by its max ``|·|``.

    The SSIM window is 7×7, or the largest odd size that fits maps smaller than that; maps need
    at least 3×3 pixels.

    Args:
        first: Reference maps (a tensor or NumPy array).
        second: Compared maps, of the same shape.
        absolute_sign: Return ``max(SSIM(a, b), SSIM(a, −b))``, for methods whose maps may flip
            sign without changing meaning.

    Raises:
        InvalidInputError: If the maps are not finite, differ in shape, are not ``(N, H, W)``
            with ``N >= 1``, or are smaller than 3×3.
    """
    from skimage.metrics import structural_similarity

    first = check_maps(first, "the first maps")
    second = check_maps(second, "the second maps")
    if first.shape != second.shape:
        raise InvalidInputError(
            f"map_ssim compares maps of the same shape; got {tuple(first.shape)} and "
            f"{tuple(second.shape)}. Compute both with the same method and inputs."
        )
    if len(first) == 0:
        raise InvalidInputError("map_ssim got no maps (batch of 0); pass at least one map each")
    height, width = first.shape[1:]
    if min(height, width) < MIN_SSIM_SIZE:
        raise InvalidInputError(
            f"SSIM needs maps of at least {MIN_SSIM_SIZE}×{MIN_SSIM_SIZE} pixels (its window is "
            f"{SSIM_WINDOW}×{SSIM_WINDOW}, smaller for smaller maps); got {height}×{width} maps. "
            "Use inputs with larger spatial size."
        )

    def normalised(maps: torch.Tensor) -> np.ndarray:
        array = maps.detach().double().cpu().numpy()
        scale = np.abs(array).reshape(len(array), -1).max(axis=1).reshape(-1, 1, 1)
        return array / np.where(scale > 0, scale, 1.0)

    a, b = normalised(first), normalised(second)
    window = min(SSIM_WINDOW, height, width)
    window -= 1 - window % 2  # odd, as SSIM needs a centre pixel
    scores = []
    for x, y in zip(a, b, strict=True):
        score = structural_similarity(x, y, data_range=2.0, win_size=window)
        if absolute_sign:
            score = max(score, structural_similarity(x, -y, data_range=2.0, win_size=window))
        scores.append(score)
    return np.asarray(scores)


def randomisation_layers(model: nn.Module) -> list[str]:
    """Names of the modules with their own parameters and ``reset_parameters``, output side first.

    Uses the registration order of the modules (the order of ``model.named_modules()``), reversed,
    which is the execution order for ordinary sequential models.
    """
    names = [
        name
        for name, module in model.named_modules()
        if name
        and hasattr(module, "reset_parameters")
        and any(True for _ in module.parameters(recurse=False))
    ]
    return names[::-1]


def cascading_randomisation(
    model: nn.Module,
    maps: MapFunction | str,
    inputs: torch.Tensor,
    targets: TargetLike,
    layers: Sequence[str] | str,
    *,
    seed: int = 0,
    absolute_sign: bool = False,
) -> list[RandomisationStep]:
    """Re-initialise ``layers`` in the given order on a copy and track map similarity.

    Args:
        model: The trained model in eval mode (left untouched: a deep copy is randomised).
        maps: ``maps(model, inputs, targets) -> (N, H, W)`` attribution maps, or a registered
            method name (its maps summed over channels, see
            :func:`explain_core.metrics.random_logit.method_maps`).
        inputs: Model inputs ``(N, ...)``, finite floating point.
        targets: Explained class: one int for all samples, or one int per sample.
        layers: Qualified names of submodules, in randomisation order (output side first); a
            single name stands for a list of one.
        seed: Seed of the re-initialisation.
        absolute_sign: See :func:`map_ssim`.

    Returns:
        One step per layer, cumulative.

    Raises:
        InvalidInputError: If a layer name does not exist or has no ``reset_parameters``, or
            for inputs, targets or maps that do not fit.
        ModelStateError: If the model is in training mode.
    """
    from explain_core.model_guard import require_eval_mode

    if isinstance(maps, str):
        from explain_core.metrics.random_logit import method_maps

        maps = method_maps(maps)
    elif not callable(maps):
        raise InvalidInputError(
            "maps must be a method name or a function maps(model, inputs, targets) -> (N, H, W); "
            f"got {type(maps).__name__}"
        )
    inputs = check_inputs(inputs, model)
    if targets is None:
        # The predicted class would change as the model is randomised: the maps must not.
        raise InvalidInputError(
            "targets must be given: one int for all samples or one int per sample"
        )
    targets = normalize_target(targets, inputs.shape[0], inputs.device)
    layers = [layers] if isinstance(layers, str) else list(layers)
    for name in layers:
        _check_resettable(model, name)
    seed = check_int(seed, "seed", 0)
    require_eval_mode(model)
    original = check_maps_result(maps(model, inputs, targets), len(targets))
    randomised = copy.deepcopy(model)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    steps, done = [], []
    try:
        for name in layers:
            for sub in _check_resettable(randomised, name):
                sub.reset_parameters()
            done.append(name)
            current = check_maps_result(maps(randomised, inputs, targets), len(targets))
            steps.append(
                RandomisationStep(
                    tuple(done), map_ssim(original, current, absolute_sign=absolute_sign)
                )
            )
    finally:
        torch.random.set_rng_state(generator_state)
    return steps


def _check_resettable(model: nn.Module, name: Any) -> list[nn.Module]:
    """The modules under layer ``name`` that have ``reset_parameters``."""
    if not isinstance(name, str):
        raise InvalidInputError(
            f"layers must be layer names (str), e.g. {randomisation_layers(model)[:2]}; "
            f"got {name!r}"
        )
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise InvalidInputError(
            f"the model has no layer named {name!r}; layers with parameters: "
            f"{', '.join(randomisation_layers(model)) or 'none'}"
        ) from None
    resettable = [m for m in module.modules() if hasattr(m, "reset_parameters")]
    if not resettable:
        raise InvalidInputError(
            f"layer {name!r} has no parameters to re-initialise; choose from "
            f"{', '.join(randomisation_layers(model)) or 'none'}"
        )
    return resettable
