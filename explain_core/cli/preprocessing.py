"""``--resize`` and ``--normalize`` of ``explain attribute`` and ``check``, or the factory's own.

The order is torchvision's: the input (an image read into [0, 1], or a ``.npy`` array as stored)
is resized to ``H × W`` (bilinear, antialiased when shrinking), then normalised per channel,
``(x − mean) / std``; the model sees the result. Pictures show the resized input before
normalisation.

A factory (or the model it returns, or the model's class) may carry the settings its model was
trained with, so that users need not repeat them::

    def build():
        return MyNet()


    build.explain_preprocessing = {
        "resize": (224, 224),
        "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225),
    }

Every key is optional (``mean`` and ``std`` go together); the command-line options replace the
factory's values, and ``--resize none`` / ``--normalize none`` switch them off. Only the standard
library is imported at the top, so that ``explain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from explain_core.cli.common import note
from explain_core.errors import InvalidInputError, ModelLoadError

__all__ = [
    "ATTRIBUTE",
    "OFF",
    "Preprocessing",
    "add_arguments",
    "choose",
    "from_model",
    "parse_normalize",
    "parse_resize",
    "prepare",
]

ATTRIBUTE = "explain_preprocessing"
"""The attribute of a factory, model or model class that holds its preprocessing."""
OFF = "none"
"""``--resize none`` / ``--normalize none``: switch the factory's setting off."""


@dataclass(frozen=True)
class Preprocessing:
    """What is done to the inputs before the model sees them.

    Attributes:
        resize: ``(height, width)`` to resize to, or ``None``.
        mean: Per-channel means (one value: every channel), or ``None`` (no normalisation).
        std: Per-channel standard deviations, as ``mean``.
    """

    resize: tuple[int, int] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def describe(self) -> str:
        """The steps in words, e.g. ``resized to 224×224, normalised with mean … and std …``."""
        steps = []
        if self.resize is not None:
            steps.append(f"resized to {self.resize[0]}×{self.resize[1]}")
        if self.mean is not None and self.std is not None:
            steps.append(f"normalised with mean {_numbers(self.mean)} and std {_numbers(self.std)}")
        return ", ".join(steps)

    def apply(self, batch: Any) -> tuple[Any, Any]:
        """Resize and normalise a batch.

        Args:
            batch: The inputs, ``(N, C, H, W)`` for images (``(N, ...)`` otherwise).

        Returns:
            ``(shown, model_input)``: the batch resized (for pictures), and resized and
            normalised (for the model).

        Raises:
            InvalidInputError: If the inputs are not images but a resize or a per-channel
                normalisation was asked for, or the channels do not match the values given.
        """
        import torch
        from torch.nn import functional

        shown = batch
        if self.resize is not None:
            if batch.dim() != 4:
                raise InvalidInputError(
                    f"--resize needs image inputs (C, H, W); these are "
                    f"{tuple(batch.shape[1:])}: leave out --resize"
                )
            shown = functional.interpolate(
                batch, size=self.resize, mode="bilinear", align_corners=False, antialias=True
            )
        if self.mean is None or self.std is None:
            return shown, shown
        mean = torch.tensor(self.mean, dtype=shown.dtype)
        std = torch.tensor(self.std, dtype=shown.dtype)
        if len(mean) > 1:
            channels = shown.shape[1] if shown.dim() >= 3 else None
            if channels != len(mean):
                what = (
                    f"{channels} channel(s)"
                    if channels is not None
                    else f"no channel axis (shape {tuple(shown.shape[1:])})"
                )
                raise InvalidInputError(
                    f"--normalize gives {len(mean)} per-channel means and standard deviations "
                    f"but the inputs have {what}; give one mean and one std (MEAN,STD) or one "
                    "per channel"
                )
            shape = (1, len(mean)) + (1,) * (shown.dim() - 2)
            mean, std = mean.reshape(shape), std.reshape(shape)
        return shown, (shown - mean) / std


def _numbers(values: Sequence[float]) -> str:
    text = ", ".join(f"{v:g}" for v in values)
    return text if len(values) == 1 else f"({text})"


def parse_resize(text: str) -> tuple[int, int] | str:
    """``--resize H,W``: two positive integers (or ``none``).

    An ``argparse`` type, so that a bad value is a usage error before anything is loaded.

    Raises:
        argparse.ArgumentTypeError: For anything else, saying what is expected.
    """
    if text.strip().lower() == OFF:
        return OFF
    parts = [part.strip() for part in text.split(",")]
    try:
        size = tuple(int(part) for part in parts)
    except ValueError:
        size = ()
    if len(size) != 2 or min(size) < 1:
        raise argparse.ArgumentTypeError(
            f"expected H,W: two positive whole numbers such as 224,224 (or none); got {text!r}"
        )
    return size[0], size[1]


def parse_normalize(text: str) -> tuple[tuple[float, ...], tuple[float, ...]] | str:
    """``--normalize MEAN,STD`` or ``M1,…,Mc,S1,…,Sc`` (c means, then c stds), or ``none``.

    An ``argparse`` type, so that a bad value is a usage error before anything is loaded.

    Raises:
        argparse.ArgumentTypeError: For an odd count, a value that is not a finite number, or a
            standard deviation that is not positive.
    """
    if text.strip().lower() == OFF:
        return OFF
    expected = (
        "MEAN,STD (e.g. 0.5,0.25) or one mean per channel then one std per channel "
        "(e.g. 0.485,0.456,0.406,0.229,0.224,0.225)"
    )
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}") from None
    if len(values) < 2 or len(values) % 2:
        raise argparse.ArgumentTypeError(
            f"expected {expected}: as many means as stds; got {len(values)} value(s) in {text!r}"
        )
    half = len(values) // 2
    try:
        return _checked(values[:half], values[half:], "--normalize")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _checked(
    mean: Sequence[float], std: Sequence[float], where: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` as tuples, or a ValueError saying what is wrong."""
    if len(mean) != len(std):
        raise ValueError(f"{where}: {len(mean)} means but {len(std)} stds; give as many of each")
    if not all(math.isfinite(v) for v in (*mean, *std)):
        raise ValueError(f"{where}: means and stds must be finite numbers")
    if min(std) <= 0:
        raise ValueError(f"{where}: standard deviations must be positive; got {_numbers(std)}")
    return tuple(mean), tuple(std)


def from_model(model: Any, reference: str) -> tuple[Preprocessing, str | None]:
    """The preprocessing that ``model`` or its factory ``reference`` declares.

    Looked up as the attribute ``explain_preprocessing`` on the model (or its class), then on
    the factory named by ``reference`` (``package.module:factory``, already imported).

    Returns:
        The preprocessing (empty when none is declared) and where it was found.

    Raises:
        ModelLoadError: If the declaration is malformed, saying how to write it.
    """
    for owner, where in ((model, f"the model's {ATTRIBUTE}"), (_factory(reference), None)):
        declared = getattr(owner, ATTRIBUTE, None) if owner is not None else None
        if declared is not None:
            where = where or f"{reference}.{ATTRIBUTE}"
            return _declared(declared, where), where
    return Preprocessing(), None


def _factory(reference: str) -> Any:
    module_name, _, attribute = reference.partition(":")
    owner: Any = sys.modules.get(module_name)
    for part in attribute.split("."):
        owner = getattr(owner, part, None)
    return owner


def _declared(declared: Any, where: str) -> Preprocessing:
    example = '{"resize": (224, 224), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}'
    if not isinstance(declared, Mapping) or set(declared) - {"resize", "mean", "std"}:
        raise ModelLoadError(
            f"{where} must be a dict with the keys resize, mean and std (each optional), e.g. "
            f"{example}; got {declared!r}"
        )
    resize = declared.get("resize")
    if resize is not None:
        resize = resize.tolist() if hasattr(resize, "tolist") else resize
        try:
            if isinstance(resize, str | bytes):
                raise TypeError("a string")
            height, width = (int(v) for v in resize)
            valid = min(height, width) >= 1 and all(float(v) == int(v) for v in resize)
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise ModelLoadError(
                f"{where}['resize'] must be (height, width), two positive whole numbers; got "
                f"{resize!r}"
            )
        resize = (height, width)
    mean, std = declared.get("mean"), declared.get("std")
    if (mean is None) != (std is None):
        raise ModelLoadError(f"{where} must give both mean and std, or neither")
    if mean is None:
        return Preprocessing(resize=resize)
    try:
        means, stds = (_floats(values) for values in (mean, std))
        means, stds = _checked(means, stds, where)
    except (TypeError, ValueError) as error:
        raise ModelLoadError(
            f"{where}: mean and std must be numbers or lists of numbers, one per channel, "
            f"with positive stds ({error})"
        ) from error
    return Preprocessing(resize=resize, mean=means, std=stds)


def _floats(values: Any) -> tuple[float, ...]:
    """A number or a list (tuple, array, tensor) of numbers as a tuple of floats."""
    values = values.tolist() if hasattr(values, "tolist") else values
    if isinstance(values, str | bytes):
        raise TypeError(f"{values!r} is text")
    return tuple(float(v) for v in (values if isinstance(values, Sequence) else [values]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--resize`` and ``--normalize`` options of a subcommand that feeds a model images."""
    parser.add_argument(
        "--resize",
        type=parse_resize,
        metavar="H,W",
        help="resize the inputs to H×W (bilinear, antialiased) before the model; none: do not, "
        "even where the factory declares a size",
    )
    parser.add_argument(
        "--normalize",
        type=parse_normalize,
        metavar="MEAN,STD",
        help="give the model (x − MEAN) / STD, after --resize; per channel: the means, then the "
        "stds (e.g. 0.485,0.456,0.406,0.229,0.224,0.225); none: do not, even where the factory "
        "declares it",
    )


def choose(args: argparse.Namespace, model: Any) -> tuple[Preprocessing, str | None]:
    """The preprocessing a command uses: its options over the factory's declaration.

    Returns:
        The preprocessing and, where the factory's declaration is used, where it came from.
    """
    declared, where = from_model(model, args.model)
    resize = declared.resize if args.resize is None else args.resize
    normalize = (declared.mean, declared.std) if args.normalize is None else args.normalize
    used = (
        where
        if (args.resize is None and declared.resize is not None)
        or (args.normalize is None and declared.mean is not None)
        else None
    )
    return (
        Preprocessing(
            resize=None if resize == OFF else resize,
            mean=None if normalize == OFF else normalize[0],
            std=None if normalize == OFF else normalize[1],
        ),
        used,
    )


def prepare(args: argparse.Namespace, model: Any, batch: Any) -> tuple[Any, Any]:
    """``batch`` prepared as :func:`choose` says, with a note where the factory's settings apply.

    Returns:
        ``(shown, model_input)`` as :meth:`Preprocessing.apply`.
    """
    steps, declared = choose(args, model)
    if declared is not None:
        note(
            f"inputs {steps.describe()}, as {declared} says (--resize and --normalize "
            "replace it; none switches it off)"
        )
    return steps.apply(batch)
