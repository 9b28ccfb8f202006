"""The layout of the original CoDA-Nets code's checkpoints, and its names in this library.

The released code (github.com/moboehle/CoDA-Nets) names each DAU layer's tensors
``<layer>.weight_mod.weighting_f.0.weight`` / ``.1.weight`` / ``.1.bias``; this library's
:class:`~explain_coda.CoDANet` names them ``layers.<layer>.dim_reduction.weight`` /
``weightings.weight`` / ``weightings.bias`` (Algorithm 1's names), in the same order and shapes.
Loading such files is :mod:`explain_coda.original`'s job; this module only renames and checks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from explain_coda.nonlinearity import Nonlinearity
from explain_coda.presets import PRESETS, LayerSpec
from explain_core.errors import ModelLoadError

__all__ = [
    "ORIGINAL_VARIANTS",
    "OriginalVariant",
    "from_original_state_dict",
    "original_key",
    "original_shapes",
    "original_variant",
]


@dataclass(frozen=True)
class OriginalVariant:
    """A model configuration of the original code, as one of this library's presets.

    Attributes:
        name: The paper's name, e.g. ``"S-CoDA-SQ"``.
        preset: The key of :data:`~explain_coda.PRESETS` with the same layers.
        nonlinearity: ``"squash"`` or ``"l2"``.
        temperature: The logit temperature ``T`` of the evaluated model.
        experiment: The original configuration (data set folder and experiment name).
    """

    name: str
    preset: str
    nonlinearity: Nonlinearity
    temperature: float
    experiment: str


ORIGINAL_VARIANTS: dict[str, OriginalVariant] = {
    variant.name: variant
    for variant in (
        OriginalVariant("S-CoDA-SQ", "S", "squash", 1000.0, "CIFAR10/final 9L-S-CoDA-SQ-1000"),
        OriginalVariant("S-CoDA-L2", "S", "l2", 1000.0, "CIFAR10/final 9L-S-CoDA-L2-1000"),
        OriginalVariant("L-CoDA", "L", "squash", 100000.0, "Imagenet/final 9L-L-CoDA-SQ-100000"),
    )
}
"""The released configurations this module maps, by the paper's names."""

_EXPERIMENTS = {"S-CoDA-SQ": "S-CoDA-SQ", "S-CoDA-L2": "S-CoDA-L2", "L-CoDA-SQ": "L-CoDA"}
_EXPERIMENT = re.compile(r"^9L-(S-CoDA-SQ|S-CoDA-L2|L-CoDA-SQ)-(\d+(?:\.\d+)?)$")
_ORIGINAL_KEY = re.compile(r"^(\d+)\.weight_mod\.weighting_f\.(0\.weight|1\.weight|1\.bias)$")
_OURS = {
    "0.weight": "dim_reduction.weight",
    "1.weight": "weightings.weight",
    "1.bias": "weightings.bias",
}
_OUR_KEY = re.compile(
    r"^layers\.(\d+)\.(dim_reduction\.weight|weightings\.weight|weightings\.bias)$"
)
_THEIRS = {ours: theirs for theirs, ours in _OURS.items()}
_PREFIX = "module."
_FACTORIES = {"S-CoDA-SQ": "s_coda_sq", "S-CoDA-L2": "s_coda_l2", "L-CoDA": "l_coda"}


def original_variant(name: str) -> OriginalVariant:
    """The variant called ``name``: a key of :data:`ORIGINAL_VARIANTS` or an experiment name.

    Args:
        name: ``"S-CoDA-SQ"``, ``"S-CoDA-L2"``, ``"L-CoDA"``, or an original experiment name
            such as ``"9L-S-CoDA-SQ-50"`` (whose number is the temperature).

    Returns:
        The variant; for an experiment name, with that experiment's temperature.

    Raises:
        ModelLoadError: For any other name (the message lists the accepted ones).
    """
    if name in ORIGINAL_VARIANTS:
        return ORIGINAL_VARIANTS[name]
    match = _EXPERIMENT.match(name)
    if match:
        variant = ORIGINAL_VARIANTS[_EXPERIMENTS[match.group(1)]]
        folder = variant.experiment.split()[0]
        return replace(variant, temperature=float(match.group(2)), experiment=f"{folder} {name}")
    raise ModelLoadError(
        f"unknown CoDA-Nets variant {name!r}; use one of {', '.join(ORIGINAL_VARIANTS)} or an "
        "original experiment name such as 9L-S-CoDA-SQ-1000 or 9L-L-CoDA-SQ-100000 (the number "
        "is the temperature); for another architecture, build a CoDANet with its LayerSpecs"
    )


def original_key(key: str) -> str:
    """The original code's name of one of :class:`CoDANet`'s state dict keys.

    Args:
        key: E.g. ``"layers.3.weightings.bias"``.

    Returns:
        E.g. ``"3.weight_mod.weighting_f.1.bias"``; a key that is not a DAU layer's, unchanged.
    """
    match = _OUR_KEY.match(key)
    if not match:
        return key
    return f"{match.group(1)}.weight_mod.weighting_f.{_THEIRS[match.group(2)]}"


def original_shapes(specs: Sequence[LayerSpec], in_channels: int) -> dict[str, tuple[int, ...]]:
    """The keys and shapes of the original code's state dict for these layers.

    Args:
        specs: The DAU layers, first to last.
        in_channels: Channels of the encoded input (6 for colour images).

    Returns:
        Original key to tensor shape, three keys per layer.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for index, spec in enumerate(specs):
        k, patch_dim = spec.kernel_size, in_channels * spec.kernel_size**2
        prefix = f"{index}.weight_mod.weighting_f"
        shapes[f"{prefix}.0.weight"] = (spec.rank, in_channels, k, k)
        shapes[f"{prefix}.1.weight"] = (spec.out_channels * patch_dim, spec.rank, 1, 1)
        shapes[f"{prefix}.1.bias"] = (spec.out_channels * patch_dim,)
        in_channels = spec.out_channels
    return shapes


def from_original_state_dict(
    state: Mapping[str, torch.Tensor], model: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """Rename an original-layout state dict to :class:`CoDANet`'s names.

    ``module.`` prefixes (``DataParallel``, ``DistributedDataParallel``) are removed first. A
    state dict without any original key (e.g. one saved by this library) is returned with only
    that done, for the caller's own checks.

    Args:
        state: Original names to tensors, e.g. a ``model_epoch_200.pkl`` read with
            :func:`explain_core.loading.load_state_dict`.
        model: When given, the renamed tensors must be exactly its tensors, names and shapes.

    Returns:
        A new dict with this library's names; the tensors are the same objects.

    Raises:
        ModelLoadError: If a key appears with and without ``module.``, the keys mix the original
            layout with others, or (with ``model``) a tensor is missing, unexpected or of another
            shape; the message names the original keys and, where the shapes fit a released
            variant, that variant.
    """
    plain: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key
        while name.startswith(_PREFIX):
            name = name[len(_PREFIX) :]
        if name in plain:
            raise ModelLoadError(
                f"the state dict holds {name!r} twice, with and without a 'module.' prefix; keep "
                "one copy of the weights (e.g. the state dict of the unwrapped model)"
            )
        plain[name] = value
    original = [key for key in plain if _ORIGINAL_KEY.match(key)]
    if not original:
        return plain
    others = sorted(key for key in plain if not _ORIGINAL_KEY.match(key))
    if others:
        raise ModelLoadError(
            f"the state dict mixes the original CoDA-Nets layout ({original[0]}, …) with other "
            f"keys ({_few(others)}); the original code's models hold only "
            "'<layer>.weight_mod.weighting_f.0.weight', '.1.weight' and '.1.bias': save the "
            "state dict of the model alone"
        )
    renamed = {}
    for key, value in plain.items():
        match = _ORIGINAL_KEY.match(key)
        assert match is not None  # every key matched above
        renamed[f"layers.{match.group(1)}.{_OURS[match.group(2)]}"] = value
    if model is not None:
        _check_fit(plain, model)
    return renamed


def _check_fit(state: Mapping[str, torch.Tensor], model: nn.Module) -> None:
    """Refuse original-layout ``state`` unless it has exactly ``model``'s names and shapes."""
    expected = {original_key(k): tuple(v.shape) for k, v in model.state_dict().items()}
    got = {key: tuple(value.shape) for key, value in state.items()}
    missing = sorted(set(expected) - set(got), key=_layer_order)
    unexpected = sorted(set(got) - set(expected), key=_layer_order)
    shapes = [
        f"{key}: file {got[key]}, model {expected[key]}"
        for key in sorted(set(got) & set(expected), key=_layer_order)
        if got[key] != expected[key]
    ]
    if not (missing or unexpected or shapes):
        return
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    if shapes:
        problems.append(f"other shapes: {_few(shapes)}")
    layers = len({key.split(".", 1)[0] for key in got})
    raise ModelLoadError(
        f"original CoDA-Nets weights ({layers} DAU layers) do not fit this CoDANet "
        f"({len(model.layers)} layers): {'; '.join(problems)}; {_advice(got)}"
    )


def _advice(got: Mapping[str, tuple[int, ...]]) -> str:
    """What to load the file as: the released variants whose shapes it has, if any."""
    fitting = [
        name
        for name, variant in ORIGINAL_VARIANTS.items()
        if original_shapes(PRESETS[variant.preset][1], PRESETS[variant.preset][0][0]) == got
    ]
    if fitting:
        how = " or ".join(
            f"load_original_coda(path, {name!r}) (--model explain_coda.original:{_FACTORIES[name]})"
            for name in fitting
        )
        same = " (their shapes are the same: pick the run's non-linearity)" if fitting[1:] else ""
        return f"its shapes are those of {' and '.join(fitting)}: load it with {how}{same}"
    return (
        "its shapes fit none of the released variants (" + ", ".join(ORIGINAL_VARIANTS) + "): "
        "build a CoDANet with one LayerSpec per layer (DAUs = rows of '.1.weight' / (in·k²), "
        "rank = rows of '.0.weight', k = its kernel size, and the run's strides) and load it "
        "with explain_core.loading.load_weights"
    )


def _layer_order(key: str) -> tuple[int, str]:
    head, _, rest = key.partition(".")
    return (int(head), rest) if head.isdigit() else (-1, key)


def _few(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
