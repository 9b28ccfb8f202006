"""What several subcommands share: model arguments, options, devices, loading and a first run.

Only the standard library is imported here, so ``explain --help`` stays fast; the model, the
registry and torch are imported by the functions that need them.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from explain_core.errors import InvalidInputError

__all__ = [
    "add_model_arguments",
    "add_option_argument",
    "check_not_overwriting",
    "load_model",
    "method_options",
    "note",
    "output_path",
    "parse_device",
    "parse_options",
    "run_model",
]


def add_model_arguments(
    parser: argparse.ArgumentParser, *, method: bool = False, hugging_face: bool = False
) -> None:
    """``--model`` and ``--weights``; with ``method``, also the required ``--method``.

    With ``hugging_face``, ``--hf FOLDER`` (a saved Hugging Face model) may replace ``--model``.
    """
    if hugging_face:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--model", help="package.module:factory")
        source.add_argument(
            "--hf", type=Path, help="a Hugging Face model folder (what save_pretrained writes)"
        )
    else:
        parser.add_argument("--model", required=True, help="package.module:factory")
    parser.add_argument(
        "--weights",
        type=Path,
        help=".safetensors file or PyTorch state dict (.pt, .pth, .bin, .ckpt, .pkl)",
    )
    if method:
        parser.add_argument("--method", required=True, help="registered method (explain plugins)")


def note(message: str) -> None:
    """Print ``explain: note: message`` on stderr: something the user should know, not an error."""
    print(f"explain: note: {message}", file=sys.stderr)


def output_path(text: str) -> Path:
    """``--out``: a file or folder path; an empty one is refused.

    An ``argparse`` type, so that ``--out ""`` (which ``Path`` reads as the current folder, where
    the inputs often are) is a usage error before anything is loaded.

    Raises:
        argparse.ArgumentTypeError: For an empty path.
    """
    if not text:
        raise argparse.ArgumentTypeError("expected a file or folder name; got an empty path")
    return Path(text)


def check_not_overwriting(
    outputs: Iterable[Path],
    inputs: Iterable[tuple[str, Path | None]],
    advice: str = "choose another --out",
) -> None:
    """Refuse to write any of ``outputs`` where one of the command's ``inputs`` is.

    Every subcommand calls this with all the files it will write before it writes or loads
    anything, so that an output never silently replaces the image, array or weights it was
    computed from.

    Args:
        outputs: The files the command will write.
        inputs: ``(what, path)`` pairs naming the files it reads, e.g. ``("--weights file",
            path)``; ``None`` paths (options not given) are skipped.
        advice: What the user should do instead.

    Raises:
        InvalidInputError: Naming the output, the input it would replace and ``advice``.
    """
    sources = [(what, Path(path)) for what, path in inputs if path is not None]
    for output in outputs:
        for what, source in sources:
            if _same_file(Path(output), source):
                raise InvalidInputError(
                    f"refusing to write {output}: it is the {what} {source}, which would be "
                    f"overwritten; {advice}"
                )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # also sees links and hard links to the same file
    except OSError:  # one of them does not exist (yet): compare where the paths lead
        pass
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # a symlink loop: the load or the write will say more
        return False


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
