"""``explain attribute``: explain one's own model on image or ``.npy`` files."""

from __future__ import annotations

import argparse
import ast
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from explain_core.errors import InvalidInputError


def add_parser(subparsers: Any) -> None:
    """Register the subcommand."""
    parser = subparsers.add_parser(
        "attribute",
        help="explain your own model on image or .npy files",
        description="Build a model from package.module:factory, load its weights (safetensors "
        "or a state dict read with torch.load(weights_only=True)), explain each input with a "
        "registered method and write a heatmap PNG and the raw .npy attribution per input.",
    )
    parser.add_argument("inputs", nargs="+", type=Path, help="image files or .npy arrays")
    parser.add_argument("--model", required=True, help="package.module:factory")
    parser.add_argument("--weights", type=Path, help=".safetensors or .pt/.pth state dict")
    parser.add_argument("--method", required=True, help="registered method (explain plugins)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--target", type=int, help="class to explain (default: predicted)")
    parser.add_argument(
        "--channels", type=int, choices=(1, 3), help="convert images to 1 or 3 channels"
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method option, repeatable (e.g. --option steps=32)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Explain every input and write its outputs."""
    from explain_core.api import explain
    from explain_core.inputs import load_input, stack_inputs
    from explain_core.loading import load_model
    from explain_core.plugin_manager import get_registry

    options = parse_options(args.option)
    get_registry()[args.method].create(**options)  # check name and options before loading
    model = load_model(args.model, args.weights)
    names = [str(path) for path in args.inputs]
    batch = stack_inputs([load_input(path, args.channels) for path in args.inputs], names)
    result = explain(model, batch, args.method, args.target, **options)
    _check_writable(args.out)
    stems = _unique_stems(args.inputs)
    for index, (path, stem) in enumerate(zip(args.inputs, stems, strict=False)):
        attribution = result.attribution[index].detach().cpu().numpy()
        npy = _write_atomically(args.out / f"{stem}.npy", lambda f, a=attribution: _save_npy(f, a))
        png = _write_atomically(
            args.out / f"{stem}.png", lambda f, a=attribution: _save_heatmap(f, a)
        )
        target = int(result.target[index])
        score = float(result.output[index, target])
        print(f"{path}: {args.method} for class {target} (score {score:.4g}) -> {png}, {npy}")
    return 0


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


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InvalidInputError(f"cannot create output folder {folder}: {error.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise InvalidInputError(f"output folder {folder} is not writable")


def _unique_stems(paths: list[Path]) -> list[str]:
    stems: list[str] = []
    for path in paths:
        stem, n = path.stem, 1
        while stem in stems:
            n += 1
            stem = f"{path.stem}-{n}"
        stems.append(stem)
    return stems


def _write_atomically(path: Path, write: Callable[[Any], None]) -> Path:
    # Write beside the target and rename, so a file that exists is always complete.
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _save_npy(handle: Any, array: Any) -> None:
    import numpy as np

    np.save(handle, array)


def _save_heatmap(handle: Any, attribution: Any) -> None:
    from PIL import Image

    from explain_core.viz import attribution_to_rgb

    heat = attribution.sum(axis=0) if attribution.ndim == 3 else attribution
    if heat.ndim != 2:
        heat = heat.reshape(1, -1)
    Image.fromarray(attribution_to_rgb(heat)).resize(
        (max(heat.shape[1], 1) * 8, max(heat.shape[0], 1) * 8), Image.Resampling.NEAREST
    ).save(handle, format="PNG")
