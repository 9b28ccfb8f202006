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

from pathlib import Path

from explain_coda.model import CoDANet
from explain_coda.original_layout import (
    ORIGINAL_VARIANTS,
    OriginalVariant,
    from_original_state_dict,
    original_key,
    original_shapes,
    original_variant,
)

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
