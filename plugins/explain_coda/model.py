"""CoDA-Nets: stacked convolutional DAU layers, global sum pooling, temperature and fixed bias.

``ŷ(x) = T⁻¹·W_{0→L}(x)·x + b₀`` (Böhle et al., eq. 9–10), where ``x`` is the encoded input
``[image, 1 − image]`` (section 3.4). The model takes the *encoded* input, because contributions
are defined on it: use :func:`encode_input` on images in [0, 1].
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from explain_coda.layers import DAUConv2d
from explain_coda.nonlinearity import Nonlinearity, check_nonlinearity
from explain_coda.original_layout import from_original_state_dict
from explain_coda.presets import DEFAULT_LOGIT_BIAS, PRESETS, LayerSpec
from explain_core.errors import InvalidInputError

__all__ = [
    "DEFAULT_LOGIT_BIAS",
    "PRESETS",
    "CoDANet",
    "LayerSpec",
    "bce_one_vs_all",
    "encode_input",
]


def encode_input(images: torch.Tensor) -> torch.Tensor:
    """``[x, 1 − x]`` along the channel axis, for images with values in [0, 1].

    Raises:
        InvalidInputError: If the images are not ``(batch, C, H, W)`` or not finite.
    """
    if images.dim() != 4:
        raise InvalidInputError(
            f"encode_input expects images of shape (batch, C, H, W); got {tuple(images.shape)}"
        )
    if not torch.isfinite(images).all():
        raise InvalidInputError("images contain NaN or infinite values")
    return torch.cat([images, 1 - images], dim=1)


class CoDANet(nn.Module):
    """A CoDA-Net built from layer specifications.

    Args:
        specs: The DAU layers, first to last; the last layer's ``out_channels`` is the number of
            classes.
        input_shape: ``(channels, height, width)`` of the encoded input (twice the image
            channels).
        temperature: Logit temperature ``T``; larger values raise the alignment pressure.
        logit_bias: Fixed bias ``b₀`` added to every logit.
        nonlinearity: ``"squash"`` or ``"l2"``, for every layer.
    """

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        input_shape: tuple[int, int, int],
        *,
        temperature: float = 1.0,
        logit_bias: float = DEFAULT_LOGIT_BIAS,
        nonlinearity: Nonlinearity = "squash",
    ) -> None:
        super().__init__()
        if not specs:
            raise ValueError("a CoDA-Net needs at least one layer spec")
        if temperature <= 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a positive number; got {temperature}")
        check_nonlinearity(nonlinearity)
        self.input_shape = tuple(input_shape)
        self.temperature = float(temperature)
        self.logit_bias = float(logit_bias)
        layers, channels = [], input_shape[0]
        for spec in specs:
            layers.append(
                DAUConv2d(channels, spec.out_channels, spec.rank, spec.kernel_size, spec.stride,
                          nonlinearity=nonlinearity)
            )  # fmt: skip
            channels = spec.out_channels
        self.layers = nn.Sequential(*layers)
        self.num_classes = channels

    @classmethod
    def from_preset(cls, name: str, **options: float | str) -> CoDANet:
        """A model from :data:`PRESETS` (``"S"``, ``"M"``, ``"L"``, ``"XL"``, ``"digits"``).

        Raises:
            ValueError: For an unknown preset name.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        shape, specs = PRESETS[name]
        return cls(specs, shape, **options)  # type: ignore[arg-type]

    def with_input_size(self, height: int, width: int) -> CoDANet:
        """A view of this model for another input size, sharing all parameters.

        CoDA-Nets are fully convolutional with sum pooling, so a model trained on single images
        can score larger inputs such as the 3×3 multi-images of the localisation metric.
        """
        view = copy.copy(self)  # new attribute dict, same submodules and parameters
        view.input_shape = (self.input_shape[0], height, width)
        return view

    def settings(self) -> dict[str, Any]:
        """The settings that shape the model's function but are not in its state dict.

        Temperature, bias, input shape and each layer's stride, padding and non-linearity (the
        layer's ``form`` is left out: every form computes the same function). Checkpoints record
        them so that a run is never resumed with a differently built model.

        Returns:
            A JSON-serialisable dict, one entry per setting.
        """
        layers = {
            f"layers.{i}": f"stride={layer.stride}, padding={layer.padding}, "
            f"nonlinearity={layer.nonlinearity!r}"
            for i, layer in enumerate(self.layers)
            if isinstance(layer, DAUConv2d)
        }
        return {
            "temperature": self.temperature,
            "logit_bias": self.logit_bias,
            "input_shape": list(self.input_shape),
            **layers,
        }

    def convert_state_dict(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with the original CoDA-Nets code's names renamed to this model's.

        :func:`explain_core.loading.load_weights` (and so ``--weights`` on the command line)
        calls this before matching names, so checkpoints of the original code load: see
        :mod:`explain_coda.original`. ``module.`` prefixes are removed; other layouts pass
        unchanged.

        Raises:
            ModelLoadError: If original-layout weights do not have this model's layers.
        """
        return from_original_state_dict(state, self)

    def check_input(self, x: torch.Tensor) -> None:
        """Raise a clear error unless ``x`` is an encoded batch of the expected shape.

        Raises:
            InvalidInputError: Wrong rank, channels (e.g. an un-encoded image), spatial size, or
                non-finite values.
        """
        channels, height, width = self.input_shape
        if x.dim() != 4 or x.shape[1] != channels:
            hint = (
                f"; it looks like un-encoded {x.shape[1]}-channel images: pass "
                "encode_input(images), which appends 1 − image"
                if x.dim() == 4 and 2 * x.shape[1] == channels
                else ""
            )
            raise InvalidInputError(
                f"CoDANet expects encoded inputs of shape (batch, {channels}, {height}, {width}); "
                f"got {tuple(x.shape)}{hint}"
            )
        if tuple(x.shape[2:]) != (height, width):
            raise InvalidInputError(
                f"CoDANet expects spatial size {height}×{width}; got {x.shape[2]}×{x.shape[3]}. "
                "Resize the images or build the model with another input_shape."
            )
        if not torch.isfinite(x).all():
            raise InvalidInputError("inputs contain NaN or infinite values")

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's map before sum pooling, ``(batch, classes, h, w)``."""
        self.check_input(x)
        return self.layers(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``T⁻¹·Σ_{h,w} features + b₀``, shape ``(batch, classes)``."""
        return self.features(x).sum(dim=(2, 3)) / self.temperature + self.logit_bias


def bce_one_vs_all(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy on sigmoid outputs, each class its own one-vs-all problem.

    Summed over classes and averaged over the batch.

    Raises:
        InvalidInputError: If a label is outside ``[0, classes)``.
    """
    n_classes = logits.shape[1]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= n_classes):
        raise InvalidInputError(
            f"labels must lie in [0, {n_classes - 1}] for a model with {n_classes} classes; got "
            f"values from {int(labels.min())} to {int(labels.max())}"
        )
    one_hot = F.one_hot(labels, logits.shape[1]).to(logits.dtype)
    return F.binary_cross_entropy_with_logits(logits, one_hot, reduction="sum") / len(labels)
