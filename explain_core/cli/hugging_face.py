"""``explain attribute --hf FOLDER``: a saved Hugging Face model explained on text or images.

The folder is what ``save_pretrained`` writes: ``config.json`` (its ``architectures`` names the
model class), ``model.safetensors`` (pickled ``.bin`` weights are never loaded) and the
tokenizer or image processor. Everything loads offline. Text is explained per token at the
embeddings (:func:`~explain_core.tokens.explain_tokens`; a language model's next token after
the text); images at their pixels, shown as the relevance of each patch laid over the image.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from explain_core.errors import InvalidInputError, ModelLoadError
from explain_core.extras import require

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def load_folder(folder: Path) -> Any:
    """The model saved in ``folder``, in eval mode.

    Raises:
        ModelLoadError: For a folder without ``config.json``, without safetensors weights, or
            whose architecture ``transformers`` does not know.
    """
    transformers = require("transformers", "explaining Hugging Face models")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"{folder} has no config.json: give the folder model.save_pretrained() wrote"
        )
    if not any((folder / name).is_file() for name in WEIGHTS):
        raise ModelLoadError(
            f"{folder} has no model.safetensors; pickled weights (pytorch_model.bin) are never "
            "loaded: save the model with model.save_pretrained(folder) (safetensors by default)"
        )
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ModelLoadError(
            f"{folder}/config.json names no model class transformers knows "
            f"(architectures: {names}); save the model with save_pretrained()"
        )
    model = model_class.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    return model.eval()


def run_hugging_face(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """Explain ``--text`` strings or image files with the model in ``--hf``."""
    from explain_core.cli.attribute import _unique_stems
    from explain_core.cli.common import check_not_overwriting

    if bool(args.text) == bool(args.inputs):
        raise InvalidInputError(
            "with --hf give either --text (repeatable) or image files, not both and not neither"
        )
    if args.text:
        stems = [f"text-{index + 1}" for index in range(len(args.text))]
        suffixes: tuple[str, ...] = (".npy", ".html", ".png")
    else:
        stems, suffixes = _unique_stems(args.inputs), (".npy", ".png")
    check_not_overwriting(
        [args.out / f"{stem}{suffix}" for stem in stems for suffix in suffixes],
        [("input file", path) for path in args.inputs],
        advice="choose another --out folder",
    )
    model = load_folder(args.hf)
    if args.text:
        return _explain_texts(model, args, stems, options)
    return _explain_images(model, args, stems, options)


def _explain_texts(
    model: Any, args: argparse.Namespace, stems: list[str], options: dict[str, Any]
) -> int:
    import numpy as np

    from explain_core.files import write_atomically
    from explain_core.tokens import explain_tokens
    from explain_core.viz import save_tokens, tokens_to_html

    transformers = require("transformers", "explaining Hugging Face models")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf, local_files_only=True)
    for index, (text, stem) in enumerate(zip(args.text, stems, strict=True)):
        batch = dict(tokenizer([text], return_tensors="pt"))
        position = -1 if _scores_per_position(model, batch) else None
        result = explain_tokens(
            model,
            batch,
            args.method,
            args.target,
            position=position,
            tokenizer=tokenizer,
            **options,
        )
        tokens, relevance = result.tokens[0], result.relevance[0]
        npy = write_atomically(args.out / f"{stem}.npy", lambda f, r=relevance: np.save(f, r))
        html = write_atomically(
            args.out / f"{stem}.html",
            lambda f, t=tokens, r=relevance: f.write(tokens_to_html(t, r).encode()),
        )
        png = save_tokens(tokens, relevance, args.out / f"{stem}.png")
        target = int(result.attribution.target[0])
        what = "next token" if position is not None else "class"
        print(f"text {index + 1}: {args.method} for {what} {target} -> {html}, {png}, {npy}")
    return 0


def _scores_per_position(model: Any, batch: dict[str, Any]) -> bool:
    """Whether the model scores every position (a language model), from one forward pass."""
    import torch

    with torch.no_grad():
        output = model(**batch)
    return getattr(output, "logits", output).dim() == 3


def _explain_images(
    model: Any, args: argparse.Namespace, stems: list[str], options: dict[str, Any]
) -> int:
    import numpy as np

    from explain_core.files import write_atomically
    from explain_core.plots import save_overlay
    from explain_core.tokens import explain_inputs

    transformers = require("transformers", "explaining Hugging Face models")
    Image = require("PIL.Image", "reading images")  # noqa: N806
    if not (args.hf / "preprocessor_config.json").is_file():
        raise ModelLoadError(
            f"{args.hf} has no preprocessor_config.json: save the image processor with the "
            "model (processor.save_pretrained(folder)), so that images are resized and "
            "normalised as in training"
        )
    processor = transformers.AutoImageProcessor.from_pretrained(
        args.hf, local_files_only=True, use_fast=False
    )
    images = [Image.open(path).convert("RGB") for path in args.inputs]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    result = explain_inputs(
        model,
        {"pixel_values": pixels},
        args.method,
        args.target,
        explained="pixel_values",
        **options,
    )
    patch = getattr(model.config, "patch_size", None)
    for index, (path, stem) in enumerate(zip(args.inputs, stems, strict=True)):
        attribution = result.attribution[index].numpy()
        npy = write_atomically(args.out / f"{stem}.npy", lambda f, a=attribution: np.save(f, a))
        target = int(result.target[index])
        png = save_overlay(
            pixels[index],
            attribution,
            args.out / f"{stem}.png",
            patch_size=patch,
            title=f"{args.method}, class {target}",
        )
        print(f"{path}: {args.method} for class {target} -> {png}, {npy}")
    return 0
