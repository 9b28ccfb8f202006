"""``explain attribute``: explain one's own model on image or ``.npy`` files."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from explain_core.cli import preprocessing
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

NAME = "attribute"
HELP = "explain your own model (or a Hugging Face model folder) on images, arrays or text"
DESCRIPTION = (
    "Build a model from package.module:factory, load its weights (safetensors or a state dict "
    "read with torch.load(weights_only=True)), explain each input with a registered method and "
    "write, per input, the raw attribution (.npy, the input's shape) and a picture (.png): the "
    "map over the input with a colour bar stating its symmetric scale. A 4-D .npy array "
    "(N, C, H, W) is a batch: its maps go to one .npy of the same shape and its pictures to "
    "STEM-0.png, STEM-1.png, …. --resize and --normalize prepare the inputs as the model was "
    "trained (resize, then (x − mean) / std); without them, the factory's explain_preprocessing "
    "attribute (or the model's) is used where it has one. With --hf FOLDER, a saved Hugging "
    "Face model explains --text strings (per token: .html, .png, .npy) or image files (the "
    "relevance of each patch over the image: .png, .npy)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    parser.add_argument(
        "inputs", nargs="*", type=Path, help="image files or .npy arrays (4-D: a batch)"
    )
    add_model_arguments(parser, method=True, hugging_face=True)
    parser.add_argument(
        "--text", action="append", default=[], help="with --hf: a text to explain (repeatable)"
    )
    parser.add_argument("--out", type=output_path, required=True, help="output folder")
    parser.add_argument("--target", type=int, help="class to explain (default: predicted)")
    parser.add_argument(
        "--channels", type=int, choices=(1, 3), help="convert images to 1 or 3 channels"
    )
    preprocessing.add_arguments(parser)
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
        if args.resize is not None or args.normalize is not None:
            raise InvalidInputError(
                "--resize and --normalize are for --model; a Hugging Face model folder resizes "
                "and normalises images as its preprocessor_config.json says"
            )
        from explain_core.cli.hugging_face import run_hugging_face

        return run_hugging_face(args, options)
    if args.text or not args.inputs:
        raise InvalidInputError(
            "give image files or .npy arrays to explain (--text needs a Hugging Face model: --hf)"
        )
    loaded = [_load(path, args.channels, load_input) for path in args.inputs]
    names = _output_names(args.inputs, [len(x) if x.dim() == 4 else None for x in loaded])
    check_not_overwriting(
        [args.out / f"{stem}.npy" for stem, _ in names]
        + [args.out / f"{picture}.png" for _, pictures in names for picture in pictures],
        [*(("input file", path) for path in args.inputs), ("--weights file", args.weights)],
        advice="choose another --out folder",
    )
    model = load_model(args)
    labels = [
        label
        for path, x in zip(args.inputs, loaded, strict=True)
        for label in ([f"{path}[{j}]" for j in range(len(x))] if x.dim() == 4 else [str(path)])
    ]
    samples = [sample for x in loaded for sample in (x.unbind(0) if x.dim() == 4 else [x])]
    batch = stack_inputs(samples, labels)
    shown, model_input = preprocessing.prepare(args, model, batch)
    run_model(
        model,
        model_input,
        hint="give inputs of the size the model was built for (--resize H,W resizes them; "
        "--channels converts images to 1 or 3 channels)",
    )
    result = explain(model, model_input, args.method, args.target, **options)
    if not torch.isfinite(result.attribution).all():
        raise InvalidInputError(
            f"{args.method} produced NaN or infinite attributions although the model's outputs "
            "are finite; try another method, or options that avoid divisions by zero (e.g. a "
            "larger epsilon)"
        )
    maps = result.attribution.detach().cpu()
    predicted = result.output.argmax(1)
    index = 0
    for x, (stem, pictures) in zip(loaded, names, strict=True):
        count = len(pictures)
        raw = maps[index : index + count].numpy() if x.dim() == 4 else maps[index].numpy()
        npy = write_atomically(args.out / f"{stem}.npy", lambda f, a=raw: _save_npy(f, a))
        for picture in pictures:
            target, guess = int(result.target[index]), int(predicted[index])
            title = f"{labels[index]}: {args.method}, class {target}" + (
                " (predicted)" if target == guess else f" (predicted: {guess})"
            )
            png = write_atomically(
                args.out / f"{picture}.png",
                lambda f, i=index, t=title: _save_picture(f, shown[i], maps[i], t),
            )
            score = float(result.output[index, target])
            print(
                f"{labels[index]}: {args.method} for class {target} (score {score:.4g}) -> "
                f"{png}, {npy}"
            )
            index += 1
    return 0


def _load(path: Path, channels: int | None, load_input: Any) -> Any:
    """One input file: a sample, or a batch when a .npy array is 4-D ``(N, C, H, W)``."""
    tensor = load_input(path, channels)
    if tensor.dim() == 4:
        if len(tensor) == 0:
            raise InvalidInputError(f"{path} is an empty batch (shape {tuple(tensor.shape)})")
        if channels is not None and tensor.shape[1] != channels:
            raise InvalidInputError(
                f"{path.name} is a batch of {tensor.shape[1]}-channel inputs but --channels "
                f"says {channels}"
            )
    elif tensor.dim() > 4:
        raise InvalidInputError(
            f"{path} has shape {tuple(tensor.shape)}: give one input (C, H, W) or (H, W), or a "
            "batch (N, C, H, W)"
        )
    return tensor


def _output_names(paths: list[Path], sizes: list[int | None]) -> list[tuple[str, list[str]]]:
    """Per input: the stem of its .npy, and the stems of its pictures (one per sample).

    Stems are unique over all outputs: a second ``a.npy`` writes ``a-2.*``, and a batch
    ``b.npy`` of two samples writes ``b.npy``, ``b-0.png`` and ``b-1.png``.
    """
    used: set[str] = set()

    def unique(stem: str) -> str:
        name, n = stem, 1
        while name in used:
            n += 1
            name = f"{stem}-{n}"
        used.add(name)
        return name

    names = []
    for path, size in zip(paths, sizes, strict=True):
        stem = unique(path.stem)
        pictures = [stem] if size is None else [unique(f"{stem}-{j}") for j in range(size)]
        names.append((stem, pictures))
    return names


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


def _save_picture(handle: Any, image: Any, attribution: Any, title: str) -> None:
    """The map over its input with a colour bar (a plain heatmap for inputs that are no image)."""
    from explain_core.plots import heatmap, overlay, save_figure

    if image.dim() in (2, 3):
        figure = overlay(image, attribution, title=title)
    else:
        figure = heatmap(attribution, title=title)
    save_figure(figure, handle, format="png")
