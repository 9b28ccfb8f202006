"""What several subcommands share: model arguments, options, devices, loading and a first run.

Only the standard library is imported here, so ``explain --help`` stays fast; the model, the
registry and torch are imported by the functions that need them.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Any

from explain_core.errors import InvalidInputError


def add_model_arguments(parser: argparse.ArgumentParser, *, method: bool = False) -> None:
    """``--model`` and ``--weights``; with ``method``, also the required ``--method``."""
    parser.add_argument("--model", required=True, help="package.module:factory")
    parser.add_argument("--weights", type=Path, help=".safetensors or .pt/.pth state dict")
    if method:
        parser.add_argument("--method", required=True, help="registered method (explain plugins)")


def add_option_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """The repeatable ``--option KEY=VALUE``; ``help`` names what the options are for."""
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help=help)


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """Turn ``["steps=32", "mode=fast"]`` into ``{"steps": 32, "mode": "fast"}``.

    Raises:
        InvalidInputError: If an entry is not ``KEY=VALUE``.
    """
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.isidentifier():
            raise InvalidInputError(f"--option expects KEY=VALUE (e.g. steps=32); got {pair!r}")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    return options


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed ``--option`` values, checked against ``--method`` before anything is loaded.

    Raises:
        InvalidInputError: On a malformed ``--option``.
        ExplainError: If the method is not registered or refuses the options.
    """
    from explain_core.plugin_manager import get_registry

    options = parse_options(args.option)
    get_registry()[args.method].create(**options)  # check name and options before loading
    return options


def load_model(args: argparse.Namespace) -> Any:
    """The model built from ``--model`` with the ``--weights`` loaded.

    Raises:
        ModelLoadError: If loading fails, or a parameter holds NaN or infinite values (every
            output would be NaN; better said now than by a blank heatmap).
    """
    import torch

    from explain_core.errors import ModelLoadError
    from explain_core.loading import load_model as load

    model = load(args.model, args.weights)
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point() and not torch.isfinite(parameter).all():
            where, fix = (
                (f"with the weights in {args.weights}", "load weights that are all finite")
                if args.weights
                else ("as its factory builds it", "initialise it with finite values")
            )
            raise ModelLoadError(
                f"parameter {name!r} of {args.model} holds NaN or infinite values {where}; {fix}"
            )
    return model


def run_model(
    model: Any,
    inputs: Any,
    *,
    min_outputs: int = 1,
    hint: str = "give inputs of the shape and channels the model was built for",
) -> Any:
    """Run ``model`` once on ``inputs`` and return its ``(batch, outputs)`` scores.

    Subcommands call this before their real work so that inputs the model cannot take, or a
    model that does not return one tensor of finite scores, end in one clear line instead of a
    traceback from deep inside torch or a method.

    Args:
        model: The loaded model.
        inputs: The batch the subcommand will use (or a part of it with every sample's shape).
        min_outputs: Fewest scores per sample the subcommand can work with.
        hint: What the user should do when the model cannot run on the inputs.

    Raises:
        InvalidInputError: For empty inputs, inputs the model raises on, outputs that are not a
            ``(batch, outputs)`` tensor with at least ``min_outputs`` scores, or non-finite
            outputs.
    """
    from explain_core.validation import check_scores, run_once

    outputs = run_once(model, inputs, hint=hint)
    check_scores(outputs, len(inputs))
    if outputs.shape[1] < min_outputs:
        raise InvalidInputError(
            f"the model must return at least {min_outputs} scores per sample; got "
            f"{outputs.shape[1]}"
        )
    return outputs


def parse_device(text: str) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (a present GPU), or ``mps`` where available.

    An ``argparse`` type, so that a bad device is a usage error before anything is loaded.

    Raises:
        argparse.ArgumentTypeError: For anything else, saying what is accepted.
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N; got {text!r}") from None
    if device.type == "cpu":
        return text
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(
                f"{text!r} was asked for but CUDA is not available here; use --device cpu"
            )
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r} does not exist: this machine has {count} GPU(s), cuda:0 to "
                f"cuda:{count - 1}"
            )
        return text
    if device.type == "mps" and torch.backends.mps.is_available():
        return text
    raise argparse.ArgumentTypeError(
        f"device {text!r} cannot run the computation here; use cpu or cuda"
    )
