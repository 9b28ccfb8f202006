"""What several subcommands share: the model arguments, ``--option`` and loading the model.

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
    """The model built from ``--model`` with the ``--weights`` loaded."""
    from explain_core.loading import load_model as load

    return load(args.model, args.weights)
