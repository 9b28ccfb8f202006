"""``explain attribute``: explain one's own model on image or ``.npy`` files."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from explain_core.cli.common import (
    add_model_arguments,
    add_option_argument,
    check_not_overwriting,
    load_model,
    method_options,
    output_path,
    run_model,
)
from explain_core.errors import InvalidInputError
from explain_core.extras import require

NAME = "attribute"
HELP = "explain your own model (or a Hugging Face model folder) on images, arrays or text"
DESCRIPTION = (
    "Build a model from package.module:factory, load its weights (safetensors or a state dict "
    "read with torch.load(weights_only=True)), explain each input with a registered method and "
    "write a heatmap PNG and the raw .npy attribution per input. With --hf FOLDER, a saved "
    "Hugging Face model explains --text strings (per token: .html, .png, .npy) or image files "
    "(the relevance of each patch over the image: .png, .npy)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    parser.add_argument("inputs", nargs="*", type=Path, help="image files or .npy arrays")
    add_model_arguments(parser, method=True, hugging_face=True)
    parser.add_argument(
        "--text", action="append", default=[], help="with --hf: a text to explain (repeatable)"
    )
    parser.add_argument("--out", type=output_path, required=True, help="output folder")
    parser.add_argument("--target", type=int, help="class to explain (default: predicted)")
    parser.add_argument(
        "--channels", type=int, choices=(1, 3), help="convert images to 1 or 3 channels"
    )
    add_option_argument(parser, "method option, repeatable (e.g. --option steps=32)")


def run(args: argparse.Namespace) -> int:
    """Explain every input and write its outputs."""
    import torch

    from explain_core.api import explain
    from explain_core.files import check_output_folder, write_atomically
    from explain_core.inputs import load_input, stack_inputs

    options = method_options(args)
    check_output_folder(args.out)  # creates nothing: the folder appears with the first output
    if args.hf is not None:
        from explain_core.cli.hugging_face import run_hugging_face

        return run_hugging_face(args, options)
    if args.text or not args.inputs:
        raise InvalidInputError(
            "give image files or .npy arrays to explain (--text needs a Hugging Face model: --hf)"
        )
    stems = _unique_stems(args.inputs)
    check_not_overwriting(
        [args.out / f"{stem}{suffix}" for stem in stems for suffix in (".npy", ".png")],
        [*(("input file", path) for path in args.inputs), ("--weights file", args.weights)],
        advice="choose another --out folder",
    )
    model = load_model(args)
    names = [str(path) for path in args.inputs]
    batch = stack_inputs([load_input(path, args.channels) for path in args.inputs], names)
    run_model(
        model,
        batch,
        hint="give inputs of the size the model was built for (--channels converts images to "
        "1 or 3 channels)",
    )
    result = explain(model, batch, args.method, args.target, **options)
    if not torch.isfinite(result.attribution).all():
        raise InvalidInputError(
            f"{args.method} produced NaN or infinite attributions although the model's outputs "
            "are finite; try another method, or options that avoid divisions by zero (e.g. a "
            "larger epsilon)"
        )
    for index, (path, stem) in enumerate(zip(args.inputs, stems, strict=False)):
        attribution = result.attribution[index].detach().cpu().numpy()
        npy = write_atomically(args.out / f"{stem}.npy", lambda f, a=attribution: _save_npy(f, a))
        png = write_atomically(
            args.out / f"{stem}.png", lambda f, a=attribution: _save_heatmap(f, a)
        )
        target = int(result.target[index])
        score = float(result.output[index, target])
        print(f"{path}: {args.method} for class {target} (score {score:.4g}) -> {png}, {npy}")
    return 0


def _unique_stems(paths: list[Path]) -> list[str]:
    stems: list[str] = []
    for path in paths:
        stem, n = path.stem, 1
        while stem in stems:
            n += 1
            stem = f"{path.stem}-{n}"
        stems.append(stem)
    return stems


def _save_npy(handle: Any, array: Any) -> None:
    import numpy as np

    np.save(handle, array)


def _save_heatmap(handle: Any, attribution: Any) -> None:
    from explain_core.viz import attribution_to_rgb

    Image = require("PIL.Image", "writing attribution pictures")  # noqa: N806

    heat = attribution.sum(axis=0) if attribution.ndim == 3 else attribution
    if heat.ndim != 2:
        heat = heat.reshape(1, -1)
    Image.fromarray(attribution_to_rgb(heat)).resize(
        (max(heat.shape[1], 1) * 8, max(heat.shape[0], 1) * 8), Image.Resampling.NEAREST
    ).save(handle, format="PNG")
