"""``explain export``: a model, optionally with its explanation, to a checked ONNX file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from explain_core.cli.common import (
    add_model_arguments,
    add_option_argument,
    check_not_overwriting,
    load_model,
    output_path,
    parse_options,
    run_model,
)
from explain_core.errors import InvalidInputError

NAME = "export"
HELP = "export a model (and its explanation) to ONNX, checked against PyTorch"
DESCRIPTION = (
    "Build a model from package.module:factory, load its weights, export it to ONNX with a "
    "dynamic batch axis (with --explain: one graph returning the logits and the explanation), "
    "run the full ONNX checker and compare onnxruntime with PyTorch on random and real inputs at "
    "two batch sizes. Prints the parity and the execution provider. Needs the onnx extra: "
    "pip install 'explain-torch[onnx]'."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    add_model_arguments(parser)
    parser.add_argument("--out", type=output_path, required=True, help="the .onnx file to write")
    parser.add_argument(
        "--explain",
        metavar="METHOD",
        help="also return this explanation (coda.contributions, capsules.saliency, "
        "input_x_gradient, the LRP composites lrp.* and excitation_bp, or one a plugin "
        "registers)",
    )
    parser.add_argument(
        "--target-input",
        action="store_true",
        help="with --explain: take the class to explain as a second input 'target' "
        "(default: explain the predicted class)",
    )
    parser.add_argument(
        "--opset",
        type=int,
        metavar="N",
        help="ONNX opset, from 15 to the newest onnxruntime loads (default: the exporter's)",
    )
    parser.add_argument(
        "--inputs",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="real samples (.npy or images, one sample each) for tracing and parity",
    )
    parser.add_argument(
        "--input-shape",
        metavar="C,H,W",
        help="shape of one input without the batch axis, when the model does not tell it and "
        "no --inputs are given",
    )
    add_option_argument(parser, "explanation option, repeatable (e.g. --option levels=11)")


def run(args: argparse.Namespace) -> int:
    """Export, check and report."""
    from explain_core.files import check_output_path
    from explain_onnx import export_onnx, get_explainer
    from explain_onnx.export import check_opset

    options = parse_options(args.option)
    if args.explain is not None:
        get_explainer(args.explain)  # check the name before loading anything
    elif options or args.target_input:
        raise InvalidInputError("--option and --target-input need --explain METHOD")
    check_opset(args.opset, name="--opset")
    check_output_path(args.out)
    check_not_overwriting(
        [args.out],
        [("--weights file", args.weights), *(("--inputs sample", p) for p in args.inputs or ())],
    )
    model = load_model(args)
    example, real = _example_inputs(args, model)
    hint = (
        "give real samples the model was built for"
        if real
        else "give --input-shape as the shape of one input the model takes, without the batch axis"
    )
    run_model(model, example, hint=hint)
    result = export_onnx(
        model,
        example,
        args.out,
        explain=args.explain,
        target_input=args.target_input,
        opset=args.opset,
        real_inputs=real,
        **options,
    )
    print(result.summary())
    return 0


def _example_inputs(args: argparse.Namespace, model: Any) -> tuple[Any, bool]:
    import torch

    from explain_core.inputs import load_input, stack_inputs

    if args.inputs:
        names = [str(path) for path in args.inputs]
        return stack_inputs([load_input(path) for path in args.inputs], names), True
    shape = _parse_shape(args.input_shape) if args.input_shape else _model_input_shape(model)
    if shape is None:
        raise InvalidInputError(
            f"cannot tell the input shape of {args.model}; give --input-shape C,H,W or real "
            "samples with --inputs"
        )
    generator = torch.Generator().manual_seed(0)
    return torch.rand((4, *shape), generator=generator), False


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise InvalidInputError(f"--input-shape expects sizes like 1,28,28; got {text!r}")
    return shape


def _model_input_shape(model: Any) -> tuple[int, ...] | None:
    for attribute in ("input_shape", "image_shape"):
        shape = getattr(model, attribute, None)
        if isinstance(shape, tuple) and shape and all(isinstance(s, int) for s in shape):
            return shape
    return None
