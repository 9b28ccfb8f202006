"""Cascading parameter randomisation (Adebayo et al., 2018): do maps depend on the weights?

Layers are re-initialised from the output backwards, one more at a time, on a *copy* of the
model; after each step the attribution maps are compared with the original ones by SSIM. Maps
that stay similar while the network is destroyed cannot reflect what the network learnt.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

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


def map_ssim(
    first: torch.Tensor, second: torch.Tensor, *, absolute_sign: bool = False
) -> np.ndarray:
    """Per-sample SSIM of two batches of ``(N, H, W)`` maps, each normalised by its max ``|·|``.

    Args:
        first: Reference maps.
        second: Compared maps.
        absolute_sign: Return ``max(SSIM(a, b), SSIM(a, −b))``, for methods whose maps may flip
            sign without changing meaning.
    """
    from skimage.metrics import structural_similarity

    def normalised(maps: torch.Tensor) -> np.ndarray:
        array = maps.detach().double().cpu().numpy()
        scale = np.abs(array).reshape(len(array), -1).max(axis=1).reshape(-1, 1, 1)
        return array / np.where(scale > 0, scale, 1.0)

    a, b = normalised(first), normalised(second)
    window = min(7, *a.shape[1:]) | 1  # odd and no larger than the map
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
    targets: torch.Tensor,
    layers: Sequence[str],
    *,
    seed: int = 0,
    absolute_sign: bool = False,
) -> list[RandomisationStep]:
    """Re-initialise ``layers`` in the given order on a copy and track map similarity.

    Args:
        model: The trained model (left untouched: a deep copy is randomised).
        maps: ``maps(model, inputs, targets) -> (N, H, W)`` attribution maps, or a registered
            method name (its maps summed over channels, see
            :func:`explain_core.metrics.random_logit.method_maps`).
        inputs: Model inputs.
        targets: Explained class per sample.
        layers: Qualified names of submodules, in randomisation order (output side first).
        seed: Seed of the re-initialisation.
        absolute_sign: See :func:`map_ssim`.

    Returns:
        One step per layer, cumulative.

    Raises:
        ValueError: If a layer name does not exist or has no ``reset_parameters``.
    """
    if isinstance(maps, str):
        from explain_core.metrics.random_logit import method_maps

        maps = method_maps(maps)
    original = maps(model, inputs, targets)
    randomised = copy.deepcopy(model)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    steps, done = [], []
    try:
        for name in layers:
            try:
                module = randomised.get_submodule(name)
            except AttributeError:
                raise ValueError(f"the model has no layer named {name!r}") from None
            resettable = [m for m in module.modules() if hasattr(m, "reset_parameters")]
            if not resettable:
                raise ValueError(f"layer {name!r} has no parameters to re-initialise")
            for sub in resettable:
                sub.reset_parameters()
            done.append(name)
            current = maps(randomised, inputs, targets)
            steps.append(
                RandomisationStep(
                    tuple(done), map_ssim(original, current, absolute_sign=absolute_sign)
                )
            )
    finally:
        torch.random.set_rng_state(generator_state)
    return steps
