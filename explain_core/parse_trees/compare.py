"""Several models' parse trees side by side, for the same samples (the paper's Fig. 6).

For example a capsule net with quantisation only (``+Q``) beside the same architecture trained
with REM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from explain_core.errors import InvalidInputError
from explain_core.files import check_output_folder
from explain_core.parse_trees.build import Threshold, parse_tree
from explain_core.parse_trees.data import ParseTreeData, as_index
from explain_core.parse_trees.render import FORMATS, RenderedTree, render_side_by_side
from explain_core.parse_trees.text import text_tree

__all__ = ["ComparedTrees", "compare_parse_trees"]


@dataclass(frozen=True)
class ComparedTrees:
    """One side-by-side picture and the trees in it.

    Attributes:
        key: ``sample-{n}``, ``class-{k}`` or ``dataset``.
        graphs: The trees, in the order of the titles.
        text: The trees as plain text (for reports and terminals).
        rendered: Where the picture went, or ``None`` when ``dot`` is missing and
            ``require_dot`` was false.
        error: Why it was not drawn, if so.
    """

    key: str
    graphs: tuple[Any, ...]
    text: str
    rendered: RenderedTree | None
    error: str | None = None


def compare_parse_trees(
    recordings: Sequence[Any],
    out_dir: str | Path,
    *,
    titles: Sequence[str] = ("DR-CapsNet+Q", "DR-CapsNet+REM"),
    samples: Sequence[int] = (),
    classes: Sequence[int] = (),
    dataset: bool = False,
    class_names: Sequence[str] | None = None,
    threshold: Threshold = None,
    keep_all_nodes: bool = True,
    format: str = "svg",
    require_dot: bool = True,
) -> list[ComparedTrees]:
    """Draw the parse trees of several recordings of the same samples side by side.

    Args:
        recordings: One per model, each a :class:`~explain_core.parse_trees.data.ParseTreeData`
            or a capsule recording (see ``ParseTreeData.from_recording``; e.g. a capsule
            plugin's record of the digits at ``levels=11``), all of the same samples.
        out_dir: Folder for the pictures (``sample-3.svg`` …) and their ``.gv`` sources.
        titles: One title per recording.
        samples: Sample indices: one picture each, every tree backtracked from that model's
            own prediction. Negative ones count from the end and are named by their
            non-negative index (``-1`` of 20 samples gives ``sample-19.svg``).
        classes: Classes: one picture each, of the per-class mean trees.
        dataset: Also draw the whole-data-set trees.
        class_names: Names of the class capsules.
        threshold: Edge threshold (see :func:`~explain_core.parse_trees.build.build_parse_tree`).
        keep_all_nodes: Draw every capsule, faded when outside the tree, so both sides share
            one layout.
        format: ``svg``, ``png`` or ``pdf``.
        require_dot: Raise when ``dot`` is missing; ``False`` records the error in the result
            instead (the ``.gv`` sources and texts are still produced).

    Every tree is built, and every argument checked, before the first picture is written.

    Returns:
        One :class:`ComparedTrees` per picture, in the order samples, classes, data set.

    Raises:
        InvalidInputError: On a titles/recordings mismatch, recordings of different samples, a
            sample out of range, a class one of the models never predicts (the message names
            that model's title), an unknown format or an output folder that cannot be written.
        GraphvizNotFoundError: If ``dot`` is missing and ``require_dot`` is true.
    """
    from explain_core.errors import GraphvizNotFoundError

    data = [ParseTreeData.from_recording(r, class_names=class_names) for r in recordings]
    if len(titles) != len(data) or not data:
        raise InvalidInputError(f"{len(titles)} titles given for {len(data)} recordings")
    if len({d.n_samples for d in data}) != 1:
        raise InvalidInputError(
            "the recordings hold different numbers of samples "
            f"({[d.n_samples for d in data]}); record the same inputs for every model"
        )
    if format not in FORMATS:
        raise InvalidInputError(f"unknown picture format {format!r}; choose one of {FORMATS}")
    jobs = _jobs(data[0], samples, classes, dataset)
    check_output_folder(out_dir)
    built = [(key, _trees(data, titles, mode, threshold, keep_all_nodes)) for key, mode in jobs]
    results = []
    for key, graphs in built:
        named = [(_title(t, g, d), g) for t, g, d in zip(titles, graphs, data, strict=True)]
        text = "\n".join(text_tree(g, title=name) for name, g in named)
        path = Path(out_dir) / f"{key}.{format}"
        try:
            rendered: RenderedTree | None = render_side_by_side(named, path, format=format)
            error = None
        except GraphvizNotFoundError as missing:
            if require_dot:
                raise
            rendered, error = None, str(missing)
        results.append(ComparedTrees(key, graphs, text, rendered, error))
    return results


def _jobs(
    data: ParseTreeData, samples: Sequence[int], classes: Sequence[int], dataset: bool
) -> list[tuple[str, dict[str, Any]]]:
    """``(picture name, parse_tree mode)`` pairs; samples normalised to ``[0, N)``."""
    indices = [data.sample_index(s) for s in samples]
    jobs: list[tuple[str, dict[str, Any]]] = [(f"sample-{i}", {"sample": i}) for i in indices]
    jobs += [(f"class-{c}", {"cls": c}) for c in (as_index(c, "a class") for c in classes)]
    if dataset:
        jobs.append(("dataset", {}))
    return jobs


def _trees(
    data: Sequence[ParseTreeData],
    titles: Sequence[str],
    mode: dict[str, Any],
    threshold: Threshold,
    keep_all_nodes: bool,
) -> tuple[Any, ...]:
    """One tree per recording; an error names the recording it is about."""
    graphs = []
    for k, (title, recording) in enumerate(zip(titles, data, strict=True), start=1):
        try:
            graphs.append(
                parse_tree(recording, threshold=threshold, keep_all_nodes=keep_all_nodes, **mode)
            )
        except InvalidInputError as error:
            raise InvalidInputError(f"recording {k} ({title}): {error}") from None
    return tuple(graphs)


def _title(title: str, graph: Any, data: ParseTreeData) -> str:
    mode = graph.graph.get("mode")
    if mode == "sample":
        predicted = data.class_name(int(graph.graph["predicted"]))
        return f"{title}: sample {graph.graph['sample']}, predicted {predicted}"
    if mode == "class":
        name = data.class_name(int(graph.graph["class_index"]))
        return f"{title}: class {name} (mean of {graph.graph['n_samples']} samples)"
    return f"{title}: all {graph.graph['n_samples']} samples"
