"""``explain parse-tree``: draw a capsule net's parse tree for an input, a class or a data set."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from explain_core.cli.common import (
    add_model_arguments,
    check_not_overwriting,
    load_model,
    note,
    output_path,
)
from explain_core.errors import InvalidInputError

DATASETS = ("digits",)
FORMATS = ("svg", "png", "pdf")


NAME = "parse-tree"
HELP = "draw the parse tree of a capsule network (graphviz)"
DESCRIPTION = (
    "Build a capsule network from package.module:factory, load its weights, record the couplings "
    "of its routing layers and draw the parse tree backtracked from the predicted class: for one "
    "input file, for a class (the mean over the data set's samples predicted as it) or for the "
    "whole data set. Nodes are capsules coloured by activation; edges are couplings above the "
    "threshold (default: the uniform coupling, 1/number of parent capsules; with --levels, the "
    "level it rounds to). Needs the graphs extra and the graphviz `dot` program."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    add_model_arguments(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--input", type=Path, help="one input (.npy or image): its parse tree")
    mode.add_argument(
        "--class",
        dest="cls",
        type=int,
        metavar="K",
        help="the mean parse tree of the samples of class K in --dataset",
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        help="data for --class, or alone: the parse tree of the whole test split (default digits)",
    )
    parser.add_argument(
        "--image-size", type=int, default=8, help="side of the digits images (default 8)"
    )
    parser.add_argument(
        "--by-label",
        action="store_true",
        help="with --class: average the samples labelled K, not those predicted as K",
    )
    parser.add_argument(
        "--channels", type=int, choices=(1, 3), help="convert an --input image to 1 or 3 channels"
    )
    parser.add_argument(
        "--out", type=output_path, required=True, help="picture file, e.g. tree.svg"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="picture format (default: from the --out suffix; without one, svg and the suffix "
        "is added)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        help="keep couplings above this (default per layer: the uniform coupling 1/number of "
        "parent capsules, with --levels the level it rounds to; 0 for a single parent)",
    )
    parser.add_argument(
        "--levels",
        type=int,
        metavar="K",
        help="round the recorded couplings into K levels (REM's c~); the model still routes "
        "with continuous couplings unless --quantised-routing is given",
    )
    parser.add_argument(
        "--quantised-routing",
        action="store_true",
        help="with --levels K: record REM's +Q model, which routes with K-level couplings, so "
        "that its predictions, activations and deeper couplings are those of the quantised model",
    )
    parser.add_argument(
        "--all-nodes",
        action="store_true",
        help="also draw the capsules outside the tree (faded)",
    )
    parser.add_argument(
        "--text", action="store_true", help="also print the tree as text on the terminal"
    )


def run(args: argparse.Namespace) -> int:
    """Record the couplings, build the tree and draw it."""
    from explain_core.extras import require
    from explain_core.files import check_output_path
    from explain_core.parse_trees import (
        class_parse_tree,
        parse_tree,
        render_parse_tree,
        text_tree,
    )

    if args.input is not None and args.dataset is not None:
        raise InvalidInputError("--dataset cannot be combined with --input")
    if args.by_label and args.cls is None:
        raise InvalidInputError("--by-label needs --class")
    if args.levels is not None and args.levels < 2:
        raise InvalidInputError(f"--levels must be at least 2; got {args.levels}")
    if args.quantised_routing and args.levels is None:
        raise InvalidInputError("--quantised-routing needs --levels K (the number of levels)")
    # fail before loading anything if the graphs extra is missing
    require("networkx", "parse-tree graphs")
    picture, format = _picture(args.out, args.format)
    check_output_path(picture)  # the picture and its .gv source share this folder
    check_not_overwriting(
        [picture, picture.with_suffix(".gv")],
        [("--input file", args.input), ("--weights file", args.weights)],
    )
    model = _load(args)
    inputs, labels, what = _inputs(args)
    data = _collect(model, inputs, args.levels, args.quantised_routing)

    def build(threshold: float | None) -> Any:  # again at 0 to explain a tree without edges
        if args.input is not None:
            return parse_tree(data, sample=0, threshold=threshold, keep_all_nodes=args.all_nodes)
        if args.cls is not None:
            return class_parse_tree(
                data,
                args.cls,
                labels=labels if args.by_label else None,
                threshold=threshold,
                keep_all_nodes=args.all_nodes,
            )
        return parse_tree(data, threshold=threshold, keep_all_nodes=args.all_nodes)

    graph = build(args.threshold)
    if args.input is not None:
        title = f"{args.input.name}: predicted class {int(data.predicted[0])}"
    elif args.cls is not None:
        how = "labelled" if args.by_label else "predicted as"
        title = f"{what}: mean of the {graph.graph['n_samples']} samples {how} class {args.cls}"
    else:
        title = f"{what}: mean of all {data.n_samples} samples"
    if args.levels is not None:
        routed = ", routed with them" if args.quantised_routing else ""
        title += f", couplings in {args.levels} levels{routed}"
    graph.graph["title"] = title
    if args.text:
        print(text_tree(graph), end="")
    rendered = render_parse_tree(graph, picture, format=format)
    edges, nodes = graph.number_of_edges(), graph.number_of_nodes()
    print(
        f"{title}: {nodes} capsules, {edges} couplings -> {rendered.path} "
        f"(DOT source {rendered.source_path})"
    )
    if edges == 0:
        note(_no_edges(graph, build))
    return 0


def _load(args: argparse.Namespace) -> Any:
    """The model with its weights; pruned weights for an unpruned model say how to load them.

    Raises:
        ModelLoadError: If loading fails.
    """
    from explain_core.errors import ModelLoadError

    try:
        return load_model(args)
    except ModelLoadError as error:
        masks = _unexpected_masks(args) if args.weights is not None else []
        if not masks:
            raise
        shown = ", ".join(masks[:3]) + (f" and {len(masks) - 3} more" if len(masks) > 3 else "")
        raise ModelLoadError(
            f"{args.weights.name} holds pruned weights with REM pruning masks ({shown}) that the "
            f"model built by {args.model} lacks; build the model with its pruner in the factory "
            "before the weights are loaded (e.g. `model = ...; MagnitudePruner(model, 0.8); "
            "return model`: the pruner creates the mask buffers, the weights fill them), or save "
            "plain weights: `remove_masks(model)` before `model.state_dict()` (the pruned "
            "weights are zero already)"
        ) from error


def _unexpected_masks(args: argparse.Namespace) -> list[str]:
    """The ``*_mask`` entries of ``--weights`` the model lacks, if they are all it lacks."""
    from explain_capsules.pruning import MASK_SUFFIX
    from explain_core.loading import load_factory, load_state_dict

    expected = set(load_factory(args.model).state_dict())
    unexpected = sorted(set(load_state_dict(args.weights)) - expected)
    if unexpected and all(name.endswith(MASK_SUFFIX) for name in unexpected):
        return unexpected
    return []


def _collect(model: Any, inputs: Any, levels: int | None, quantised_routing: bool) -> Any:
    """The parse-tree data of ``inputs``; REM's +Q model routes with K-level couplings."""
    from contextlib import nullcontext

    from explain_core.parse_trees import collect_parse_tree_data

    routing: Any = nullcontext()
    if quantised_routing:
        from explain_capsules.rem import quantised_routing as quantised

        routing = quantised(model, levels=levels)
    with routing:
        return collect_parse_tree_data(model, inputs, levels=levels)


def _picture(out: Path, format: str | None) -> tuple[Path, str]:
    """The picture's path and format from ``--out`` and ``--format``.

    Raises:
        InvalidInputError: For a folder, a suffix other than those of ``FORMATS``, or one that
            contradicts ``--format`` (the renderer would append its own: ``t.jpg.svg``).
    """
    if out.is_dir():  # else it would become out.svg beside the folder
        raise InvalidInputError(
            f"--out {out} is a folder; give a picture file, e.g. --out {out / 'tree.svg'}"
        )
    suffix = out.suffix.lower().lstrip(".")
    if not suffix:
        format = format or "svg"
        return out.with_name(f"{out.name}.{format}"), format
    if suffix not in FORMATS:
        raise InvalidInputError(
            f"--out {out}: parse trees are drawn as {', '.join(FORMATS)}; got .{suffix}; end "
            "--out in .svg, .png or .pdf"
        )
    if format is not None and format != suffix:
        raise InvalidInputError(
            f"--out {out} ends in .{suffix} but --format is {format}; end --out in .{format} "
            "or leave --format out"
        )
    return out, suffix


def _no_edges(graph: Any, build: Callable[[float | None], Any]) -> str:
    """Why the tree has no edges, with the strongest coupling into its root(s)."""
    roots = graph.graph["roots"].split(",")
    thresholds = sorted(set(graph.graph["thresholds"].split(",")))
    everything = build(0.0)  # every coupling above zero, to tell the strongest one
    into_roots = [w for _, v, w in everything.edges(data="weight") if v in roots]
    whom = roots[0] if len(roots) == 1 else "the class capsules"
    strongest = f" (the strongest into {whom} is {max(into_roots):.3g})" if into_roots else ""
    return (
        f"the tree has no edges: no coupling is above the threshold {' / '.join(thresholds)}"
        f"{strongest}; give a lower --threshold"
    )


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """The batch to record, its labels (if known) and a short description."""
    if args.input is not None:
        from explain_core.inputs import load_input

        return load_input(args.input, args.channels)[None], None, str(args.input.name)
    from explain_core.data import load_digits

    try:
        digits = load_digits(image_size=args.image_size)
    except ValueError as error:
        raise InvalidInputError(f"--image-size: {error}") from None
    return digits.test_images, digits.test_labels, "digits test split"
