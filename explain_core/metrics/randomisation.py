"""Cascading parameter randomisation (Adebayo et al., 2018): do maps depend on the weights?

Layers are re-initialised from the output backwards, one more at a time, on a *copy* of the
model; after each step the attribution maps are compared with the original ones by SSIM. Maps
that stay similar while the network is destroyed cannot reflect what the network learnt.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from explain_core.errors import InvalidInputError
from explain_core.extras import require
from explain_core.metrics._checks import (
    Layout,
    check_int,
    check_maps,
    check_maps_result,
    input_layout,
    required_targets,
)
from explain_core.metrics.maps import resolve_maps
from explain_core.targets import TargetLike
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
    at least 3×3 pixels. For ``(N, C, L)`` signals use :func:`signal_ssim`.

    Args:
        first: Reference maps (a tensor or NumPy array).
        second: Compared maps, of the same shape.
        absolute_sign: Return ``max(SSIM(a, b), SSIM(a, −b))``, for methods whose maps may flip
            sign without changing meaning.

    Raises:
        InvalidInputError: If the maps are not finite, differ in shape, are not ``(N, H, W)``
            with ``N >= 1``, or are smaller than 3×3.
    """
    first = check_maps(first, "the first maps")
    second = check_maps(second, "the second maps")
    _check_same_shape(first, second, "map_ssim")
    height, width = first.shape[1:]
    if min(height, width) < MIN_SSIM_SIZE:
        raise InvalidInputError(
            f"SSIM needs maps of at least {MIN_SSIM_SIZE}×{MIN_SSIM_SIZE} pixels (its window is "
            f"{SSIM_WINDOW}×{SSIM_WINDOW}, smaller for smaller maps); got {height}×{width} maps. "
            "Use inputs with larger spatial size."
        )
    window = min(SSIM_WINDOW, height, width)
    return _ssim(first, second, window - (1 - window % 2), None, absolute_sign)


def signal_ssim(
    first: torch.Tensor, second: torch.Tensor, *, absolute_sign: bool = False
) -> np.ndarray:
    """Per-sample 1-d SSIM of two batches of ``(N, C, L)`` signal maps, normalised like maps.

    Each channel is compared along its length ``L`` (skimage's ``structural_similarity`` on
    ``(C, L)`` with ``channel_axis=0``) and the channels' SSIMs are averaged; channels are never
    slid over as if they were a spatial axis. ``(N, L)`` maps count as one channel. The window
    is 7 samples, or the largest odd length that fits shorter signals; signals need ``L >= 3``.

    Args:
        first: Reference maps (a tensor or NumPy array).
        second: Compared maps, of the same shape.
        absolute_sign: Return ``max(SSIM(a, b), SSIM(a, −b))`` (see :func:`map_ssim`).

    Raises:
        InvalidInputError: If the maps are not finite, differ in shape, are not ``(N, C, L)``
            with ``N >= 1``, or are shorter than 3.
    """
    first = check_maps(first, "the first maps", layout="signal")
    second = check_maps(second, "the second maps", layout="signal")
    _check_same_shape(first, second, "signal_ssim")
    length = first.shape[2]
    if length < MIN_SSIM_SIZE:
        raise InvalidInputError(
            f"SSIM needs signals of at least {MIN_SSIM_SIZE} samples (its window is "
            f"{SSIM_WINDOW}, smaller for shorter signals); got length {length}. Use longer "
            "inputs."
        )
    window = min(SSIM_WINDOW, length)
    return _ssim(first, second, window - (1 - window % 2), 0, absolute_sign)


def _check_same_shape(first: torch.Tensor, second: torch.Tensor, caller: str) -> None:
    if first.shape != second.shape:
        raise InvalidInputError(
            f"{caller} compares maps of the same shape; got {tuple(first.shape)} and "
            f"{tuple(second.shape)}. Compute both with the same method and inputs."
        )
    if len(first) == 0:
        raise InvalidInputError(f"{caller} got no maps (batch of 0); pass at least one map each")


def _ssim(
    first: torch.Tensor,
    second: torch.Tensor,
    window: int,
    channel_axis: int | None,
    absolute_sign: bool,
) -> np.ndarray:
    """Per-sample SSIM of maps normalised by their max ``|·|``, so values lie in [−1, 1]."""
    structural_similarity = require("skimage.metrics", "SSIM").structural_similarity

    def normalised(maps: torch.Tensor) -> np.ndarray:
        array = maps.detach().double().cpu().numpy()
        scale = np.abs(array).reshape(len(array), -1).max(axis=1)
        scale = scale.reshape(-1, *([1] * (array.ndim - 1)))
        return array / np.where(scale > 0, scale, 1.0)

    def ssim(x: np.ndarray, y: np.ndarray) -> float:
        return structural_similarity(
            x, y, data_range=2.0, win_size=window, channel_axis=channel_axis
        )

    scores = []
    for x, y in zip(normalised(first), normalised(second), strict=True):
        score = ssim(x, y)
        if absolute_sign:
            score = max(score, ssim(x, -y))
        scores.append(score)
    return np.asarray(scores)


def compare_maps(
    first: torch.Tensor, second: torch.Tensor, layout: Layout, *, absolute_sign: bool = False
) -> np.ndarray:
    """:func:`map_ssim` for image maps, :func:`signal_ssim` for signal maps."""
    compare = signal_ssim if layout == "signal" else map_ssim
    return compare(first, second, absolute_sign=absolute_sign)


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
    **options: Any,
) -> list[RandomisationStep]:
    """Re-initialise ``layers`` in the given order on a copy and track map similarity.

    Image inputs ``(N, C, H, W)`` are compared as ``(N, H, W)`` maps by :func:`map_ssim`;
    signal inputs ``(N, C, L)`` as ``(N, C, L)`` maps by :func:`signal_ssim`.

    Args:
        model: The trained model in eval mode (left untouched: a deep copy is randomised).
        maps: ``maps(model, inputs, targets) -> (N, H, W)`` attribution maps (``(N, C, L)`` for
            signal inputs), or a registered method name (``options`` go to the method; its maps
            are summed over channels for images, see
            :func:`explain_core.metrics.maps.method_maps`).
        inputs: Model inputs ``(N, ...)``, finite floating point.
        targets: Explained class: one int for all samples, or one int per sample.
        layers: Qualified names of submodules, in randomisation order (output side first); a
            single name stands for a list of one.
        seed: Seed of the re-initialisation.
        absolute_sign: See :func:`map_ssim`.
        **options: Options of the method when ``maps`` is a name, e.g. ``steps=20``.

    Returns:
        One step per layer, cumulative.

    Raises:
        InvalidInputError: If ``layers`` is empty, a layer name does not exist or has no
            ``reset_parameters``, for inputs, targets, options or maps that do not fit, or for a
            method name inside ``torch.inference_mode()``.
        ModelStateError: If the model is in training mode.
    """
    from explain_core.model_guard import require_eval_mode

    maps = resolve_maps(maps, options, "cascading_randomisation()")
    inputs = check_inputs(inputs, model)
    layout = input_layout(inputs)
    # Not the predicted class: it would change as the model is randomised, the maps must not.
    targets = required_targets(targets, inputs)
    layers = [layers] if isinstance(layers, str) else list(layers)
    if not layers:
        # An empty list would return no steps, which reads like a test that was passed.
        raise InvalidInputError(
            "layers is empty; name at least one layer to re-initialise, output side first, e.g. "
            f"{randomisation_layers(model)[:3]} (randomisation_layers(model) lists them all)"
        )
    for name in layers:
        _check_resettable(model, name)
    seed = check_int(seed, "seed", 0)
    require_eval_mode(model)
    original = check_maps_result(maps(model, inputs, targets), len(targets), layout)
    randomised = copy.deepcopy(model)
    # The draws come from generators of this call, never from torch's global one: seeding that
    # would hand the seeded stream to other threads drawing meanwhile (and theirs to this one).
    seeded = _SeededDraws(seed)
    steps, done = [], []
    for name in layers:
        with seeded:
            for sub in _check_resettable(randomised, name):
                sub.reset_parameters()
        done.append(name)
        current = check_maps_result(maps(randomised, inputs, targets), len(targets), layout)
        similarity = compare_maps(original, current, layout, absolute_sign=absolute_sign)
        steps.append(RandomisationStep(tuple(done), similarity))
    return steps


# Random calls that take a ``generator`` (``nn.init``'s functions are found by their signature).
_RANDOM_CALLS = frozenset(
    [
        *(
            getattr(torch.Tensor, name)
            for name in (
                "uniform_",
                "normal_",
                "random_",
                "bernoulli_",
                "bernoulli",
                "exponential_",
                "geometric_",
                "cauchy_",
                "log_normal_",
                "multinomial",
            )
        ),
        *(
            getattr(torch, name)
            for name in (
                "rand",
                "randn",
                "randint",
                "randperm",
                "normal",
                "bernoulli",
                "multinomial",
                "poisson",
            )
        ),
    ]
)


def _takes_generator(func: Any) -> bool:
    if func in _RANDOM_CALLS:
        return True
    if getattr(func, "__module__", None) != "torch.nn.init":
        return False
    try:
        return "generator" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


class _SeededDraws(TorchFunctionMode):
    """Gives the random calls of this thread without a ``generator`` one of its own, by seed.

    One generator per device, seeded with ``seed`` on first use and drawn on across blocks: the
    numbers ``torch.manual_seed(seed)`` would give, without touching the global generator.
    Random calls that take no generator (``torch.rand_like``) still draw from the global one.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("generator") is None and _takes_generator(func):
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            device = torch.device(tensor.device if tensor is not None else "cpu")
            device = torch.device(kwargs.get("device") or device)
            if device not in self.generators:
                self.generators[device] = torch.Generator(device).manual_seed(self.seed)
            kwargs["generator"] = self.generators[device]
        return func(*args, **kwargs)


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
