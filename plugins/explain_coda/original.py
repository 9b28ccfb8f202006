r"""Checkpoints of the original CoDA-Nets code, loaded onto the Table C1 presets.

The released code (github.com/moboehle/CoDA-Nets, Böhle et al., CVPR 2021) builds a CoDA-Net as
one ``nn.Sequential``: its DAU layers, then a sum pooling and a final layer that divides by the
temperature and adds the logit bias. Only the DAU layers hold tensors, three each; in layer ``i``
(``in`` input channels, ``out`` DAUs of rank ``rank``, ``k × k`` patches), original key, shape
and :class:`CoDANet`'s name:

- ``{i}.weight_mod.weighting_f.0.weight``, ``(rank, in, k, k)``: ``layers.{i}.dim_reduction.weight``
  (``B``, a convolution without bias);
- ``{i}.weight_mod.weighting_f.1.weight``, ``(out·in·k², rank, 1, 1)``:
  ``layers.{i}.weightings.weight`` (``A``);
- ``{i}.weight_mod.weighting_f.1.bias``, ``(out·in·k²,)``: ``layers.{i}.weightings.bias`` (``b``).

Both codes read channel ``p·out + j`` of the second convolution as entry ``p`` (in ``F.unfold``
order) of DAU ``j``'s weight vector, so the mapping renames and never reorders a tensor.

What a state dict does not hold comes from the variant: the temperature ``T`` and the logit bias
``b₀ = log(0.1/0.9)`` (plain attributes of the final layer), the non-linearity (squashing or L2:
modules without tensors), strides and paddings (``(k − 1) // 2`` in every released
configuration); the ``[x, 1 − x]`` input encoding is done by the original trainer outside the
model, so pass :func:`~explain_coda.encode_input` of images in [0, 1]:

=============  ======  =============  ========  ===========================================
variant        preset  non-linearity  ``T``     original experiment (its name ends in ``T``)
=============  ======  =============  ========  ===========================================
``S-CoDA-SQ``  ``S``   ``squash``     1000      ``CIFAR10/final``, ``9L-S-CoDA-SQ-1000``
``S-CoDA-L2``  ``S``   ``l2``         1000      ``CIFAR10/final``, ``9L-S-CoDA-L2-1000``
``L-CoDA``     ``L``   ``squash``     100000    ``Imagenet/final``, ``9L-L-CoDA-SQ-100000``
=============  ======  =============  ========  ===========================================

Experiment names are accepted as variants too, and give their temperature: the CIFAR-10
temperature ablation ``9L-S-CoDA-SQ-50`` is S-CoDA-SQ with ``T = 50``. (As released, the L2
configuration's ``L2Norm`` returns the normalised weights rather than their norm, which the layer
then divides by; ``S-CoDA-L2`` computes the paper's L2 DAU, ``wᵀx / ‖w‖``.)

The original trainer saves ``torch.save(model.state_dict(), path)`` as ``model_epoch_<epoch>.pkl``
(best epochs) and ``last_model_epoch_<epoch>.pkl``: plain state dicts, never whole model objects,
which ``torch.load(weights_only=True)`` reads in both the zip format and the legacy format of the
torch 1.3 it pins. Runs wrapped in ``DataParallel``/``DistributedDataParallel`` prefix every key
with ``module.``; the prefix is removed here. (The repository's README links no trained weights:
the checkpoints are those its trainer writes.)

Example::

    from explain_coda import coda_contributions, encode_input
    from explain_coda.original import load_original_coda

    model = load_original_coda("9L-S-CoDA-SQ-1000/model_epoch_200.pkl", "S-CoDA-SQ")
    x = encode_input(images)  # images in [0, 1], (batch, 3, 32, 32)
    logits = model(x)
    maps = coda_contributions(model, x).contributions.sum(1)  # (batch, 32, 32), predicted class

and from the command line, on encoded ``(6, 32, 32)`` arrays (:func:`s_coda_sq`, :func:`s_coda_l2`
and :func:`l_coda` are the factories)::

    explain attribute x.npy --model explain_coda.original:s_coda_sq \
        --weights model_epoch_200.pkl --method coda.contributions --out maps/

Any :class:`CoDANet` reads this layout through :func:`explain_core.loading.load_weights` (its
``convert_state_dict`` calls :func:`from_original_state_dict`), so a factory of one's own, e.g.
``CoDANet.from_preset("S", temperature=50.0)``, loads these files as well.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from explain_coda.model import PRESETS, CoDANet, LayerSpec
from explain_coda.nonlinearity import Nonlinearity
from explain_core.errors import ModelLoadError

__all__ = [
    "ORIGINAL_VARIANTS",
    "OriginalVariant",
    "from_original_state_dict",
    "l_coda",
    "load_original_coda",
    "original_key",
    "original_model",
    "original_shapes",
    "original_variant",
    "s_coda_l2",
    "s_coda_sq",
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


def original_model(variant: str = "S-CoDA-SQ", *, temperature: float | None = None) -> CoDANet:
    """An untrained :class:`CoDANet` built as the original code builds ``variant``.

    Args:
        variant: See :func:`original_variant`.
        temperature: Overrides the variant's temperature (it is not stored in checkpoints).

    Returns:
        The model; it takes encoded inputs ``[x, 1 − x]`` of the preset's shape.

    Raises:
        ModelLoadError: For an unknown variant.
    """
    chosen = original_variant(variant)
    return CoDANet.from_preset(
        chosen.preset,
        temperature=chosen.temperature if temperature is None else temperature,
        nonlinearity=chosen.nonlinearity,
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
    state: Mapping[str, torch.Tensor], model: CoDANet | None = None
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


def load_original_coda(
    path: str | Path, variant: str = "S-CoDA-SQ", *, temperature: float | None = None
) -> CoDANet:
    """Build ``variant`` and load a checkpoint of the original CoDA-Nets code into it.

    The file is read with ``torch.load(weights_only=True)`` (or as safetensors): tensors only,
    never pickled objects. Files in this library's own layout load too.

    Args:
        path: E.g. ``model_epoch_200.pkl``, as the original trainer wrote it, with or without
            ``module.`` prefixes.
        variant: ``"S-CoDA-SQ"`` (default), ``"S-CoDA-L2"``, ``"L-CoDA"`` or an original
            experiment name such as ``"9L-S-CoDA-SQ-50"`` (see :func:`original_variant`).
        temperature: Overrides the variant's temperature ``T``. Checkpoints do not store it: the
            experiment's name does. ``T`` divides the logits and the contributions; it does not
            change which class wins.

    Returns:
        The model in eval mode, on the CPU; it takes encoded inputs (:func:`encode_input`).

    Raises:
        ModelLoadError: If the file cannot be read safely (e.g. a whole pickled model), or its
            keys or shapes are not those of ``variant`` (the message says which variant they
            fit, if any).
    """
    from explain_core.loading import load_weights

    chosen = original_variant(variant)
    model = original_model(variant, temperature=temperature)
    load_weights(model, path, name=f"{chosen.name} (preset {chosen.preset!r})")
    return model.eval()


def s_coda_sq() -> CoDANet:
    """Factory for the CLI: S-CoDA-SQ (``T = 1000``) that loads original checkpoints."""
    return original_model("S-CoDA-SQ")


def s_coda_l2() -> CoDANet:
    """Factory for the CLI: S-CoDA-L2 (``T = 1000``) that loads original checkpoints."""
    return original_model("S-CoDA-L2")


def l_coda() -> CoDANet:
    """Factory for the CLI: L-CoDA (``T = 100000``, 240×240) that loads original checkpoints."""
    return original_model("L-CoDA")


def _check_fit(state: Mapping[str, torch.Tensor], model: CoDANet) -> None:
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
