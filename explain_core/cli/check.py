"""``explain check``: the faithfulness card of one method on one model and data.

The card itself is :func:`explain_core.metrics.faithfulness_card`; this command loads the model
and the data, prints the card as a table and writes it as JSON (``--out``, written only when
complete).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

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
from explain_core.files import check_output_path
from explain_core.metrics.card import faithfulness_card, format_card

DATASETS = ("digits",)


NAME = "check"
HELP = "faithfulness card of one method on your model and data"
DESCRIPTION = (
    "Compute a faithfulness card (completeness, CSC at the first layer, random-logit SSIM, "
    "randomisation SSIM) for one registered method on a model built from package.module:factory "
    "with its weights, on image/.npy files or a bundled data set, resized and normalised as "
    "--resize and --normalize (or the factory's explain_preprocessing) say. Prints a table; --out "
    "also writes it as JSON."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    parser.add_argument("inputs", nargs="*", type=Path, help="image files or .npy arrays")
    add_model_arguments(parser, method=True)
    parser.add_argument(
        "--dataset", choices=DATASETS, help="use the bundled test split instead of files"
    )
    parser.add_argument(
        "--image-size", type=int, default=8, help="side of the bundled digits (default: 8)"
    )
    parser.add_argument(
        "--samples", type=int, default=32, help="samples taken from --dataset (default: 32)"
    )
    parser.add_argument(
        "--target", type=int, help="class explained for file inputs (default: predicted)"
    )
    parser.add_argument(
        "--channels", type=int, choices=(1, 3), help="convert images to 1 or 3 channels"
    )
    preprocessing.add_arguments(parser)
    add_option_argument(parser, "method option, repeatable (e.g. --option epsilon=0.25)")
    parser.add_argument(
        "--vectors", type=int, default=5, help="random vectors per sample for CSC (default: 5)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of all random choices")
    parser.add_argument("--out", type=output_path, help="also write the card as JSON to this file")


def run(args: argparse.Namespace) -> int:
    """Load model and data, compute the card, print it and write the JSON."""
    options = method_options(args)
    if args.vectors < 2:
        raise InvalidInputError(f"--vectors must be at least 2; got {args.vectors}")
    if args.dataset and args.inputs:
        raise InvalidInputError("give input files or --dataset, not both")
    if not args.dataset and not args.inputs:
        raise InvalidInputError("give input files (images or .npy) or --dataset digits")
    if args.out is not None:
        check_output_path(args.out)  # creates nothing: the card is written only when complete
        check_not_overwriting(
            [args.out],
            [*(("input file", path) for path in args.inputs), ("--weights file", args.weights)],
        )
    model = load_model(args)
    images, labels = _load_data(args)
    _, images = preprocessing.prepare(args, model, images)  # the card: what the model sees
    outputs = run_model(model, images, min_outputs=2, hint=_size_hint(args))
    if args.dataset:
        targets = labels
        if args.target is not None:
            raise InvalidInputError("--target applies to file inputs; --dataset uses the labels")
    elif args.target is not None:
        if not 0 <= args.target < outputs.shape[1]:
            raise InvalidInputError(
                f"target {args.target} is out of range: the model has {outputs.shape[1]} "
                f"outputs, [0, {outputs.shape[1] - 1}]"
            )
        targets = torch.full((len(images),), args.target, dtype=torch.long)
    else:
        targets = outputs.argmax(dim=1)
    if labels is not None and targets is labels and int(labels.max()) >= outputs.shape[1]:
        raise InvalidInputError(
            f"the data set has {int(labels.max()) + 1} classes but the model only "
            f"{outputs.shape[1]} outputs"
        )
    card = faithfulness_card(
        model, images, targets, args.method, seed=args.seed, n_vectors=args.vectors, **options
    )
    card["model"] = args.model
    card["weights"] = None if args.weights is None else str(args.weights)
    card["data"] = args.dataset or [str(p) for p in args.inputs]
    card["options"] = {k: repr(v) for k, v in options.items()}
    print(format_card(card))
    if args.out is not None:
        _write_json(args.out, card)
        print(f"wrote {args.out}")
    return 0


def _load_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor | None]:
    if args.dataset:
        from explain_core.data import load_digits

        if args.samples < 1:
            raise InvalidInputError(f"--samples must be at least 1; got {args.samples}")
        if args.image_size < 8:
            raise InvalidInputError(f"--image-size must be at least 8; got {args.image_size}")
        digits = load_digits(image_size=args.image_size, seed=0)
        count = min(args.samples, len(digits.test_labels))
        images = digits.test_images[:count]
        if args.channels == 3:
            images = images.expand(-1, 3, -1, -1).contiguous()
        return images, digits.test_labels[:count]
    from explain_core.inputs import load_input, stack_inputs

    names = [str(path) for path in args.inputs]
    batch = stack_inputs([load_input(path, args.channels) for path in args.inputs], names)
    return batch, None


def _size_hint(args: argparse.Namespace) -> str:
    if args.dataset:
        return "set --image-size to the side the model was built for"
    return (
        "give inputs of the size the model was built for (--resize H,W resizes them; --channels "
        "converts images to 1 or 3 channels)"
    )


def _write_json(path: Path, card: dict[str, Any]) -> None:
    from explain_core.files import write_atomically

    text = json.dumps(card, indent=2)
    write_atomically(path, lambda handle: handle.write(text.encode("utf-8")))
