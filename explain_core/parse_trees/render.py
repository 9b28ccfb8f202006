"""Drawing parse trees with graphviz: SVG, PNG or PDF, one tree or several side by side.

Capsule layers are ranks (``rank=same``), primary capsules at the bottom and the classes at the
top; nodes keep their index order within a rank. Side by side, the trees' class rows share one
rank, and so does every row at the same distance below it, so that trees of different depths
line up at their classes. A node's fill comes from a matplotlib colormap of its activation
``‖u‖`` in ``[0, 1]``; an edge's pen width and opacity grow with its coupling. Nodes are circles
at least 0.42 inch wide that grow to fit their label (long class names, ``C1000``). Capsules
added by ``keep_all_nodes`` that are not in the tree are drawn faded and dashed.

The DOT source is generated here and always written next to the picture (``t.svg`` → ``t.gv``)
before graphviz runs, so it exists even when the ``dot`` program is missing; then
:class:`~explain_core.errors.GraphvizNotFoundError` says how to install it, and
:func:`~explain_core.parse_trees.text.text_tree` draws the tree in a terminal instead. When
``dot`` runs but fails (e.g. a graphviz built without the PNG or PDF plugin),
:class:`GraphvizRenderError` gives its message in one line. The source is named after the
picture's stem: ``t.svg`` and ``t.png`` share ``t.gv``, which holds the source of the picture
drawn last; give pictures of different trees different stems.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from explain_core.errors import (
    GraphvizNotFoundError,
    GraphvizRenderError,
    InvalidInputError,
)
from explain_core.extras import require
from explain_core.files import OutputPathError, check_output_path, write_atomically
from explain_core.parse_trees.build import check_parse_tree

__all__ = [
    "FORMATS",
    "GraphvizRenderError",
    "RenderedTree",
    "render_parse_tree",
    "render_side_by_side",
    "to_dot",
]

FORMATS = ("svg", "png", "pdf")
DOT_INSTALL_HINT = (
    "install the graphviz program: Debian/Ubuntu `apt-get install graphviz` (the package "
    "`graphviz`), macOS `brew install graphviz`, conda `conda install graphviz`"
)


@dataclass(frozen=True)
class RenderedTree:
    """Where a rendering went.

    Attributes:
        path: The picture (SVG, PNG or PDF).
        source_path: The DOT source (``.gv``) it was drawn from.
    """

    path: Path
    source_path: Path


def to_dot(
    trees: Any | Sequence[tuple[str, Any]],
    *,
    title: str | None = None,
    colormap: str = "viridis",
) -> str:
    """DOT source of one parse tree, or of several ``(title, graph)`` pairs side by side.

    Every layer is one ``rank=same`` row holding, left to right, each tree's layer label and
    capsules in index order (kept by invisible edges along the row); side by side, rows are
    matched by their distance below the class row (trees of different depths share the class
    row), and a title node heads each tree.

    Args:
        trees: A parse-tree graph, or ``(title, graph)`` pairs drawn left to right.
        title: Title over the whole picture (one tree: default its ``title`` attribute).
        colormap: Matplotlib colormap for the activation ``‖u‖`` in ``[0, 1]``.

    Returns:
        The source text. With one tree, DOT node names are the node ids (``L2:C5``); side by
        side, tree ``k`` (from 1) prefixes them with ``t{k}/``.

    Raises:
        InvalidInputError: If no tree is given, or a tree is not a parse tree.
    """
    cmap = require("matplotlib", "colouring parse trees").colormaps[colormap]
    single = not isinstance(trees, (list, tuple))
    pairs = [(None, trees)] if single else list(trees)
    if not pairs:
        raise InvalidInputError("nothing to draw: no parse trees given")
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidInputError(
                f"side by side, give (title, graph) pairs; got {type(pair).__name__}"
            )
        check_parse_tree(pair[1])
    if single and title is None:
        title = pairs[0][1].graph.get("title")
    legend = f"fill: ‖u‖ ({colormap}, 0 → 1)   edges: coupling c (width, opacity)"
    lines = [
        "digraph parse_tree {",
        "\tgraph [rankdir=BT, nodesep=0.12, ranksep=0.55, fontname=Helvetica, labelloc=t, "
        f"label={_quote(title + chr(10) + legend if title else legend)}, fontsize=12]",
        # Not fixedsize: a circle grows to fit a long label instead of clipping it (and dot
        # warning "size too small for label" once per node); width and height are minimums.
        "\tnode [shape=circle, style=filled, fixedsize=false, width=0.42, height=0.42, "
        "margin=0.03, fontname=Helvetica, fontsize=9, penwidth=0.8]",
        "\tedge [arrowhead=none]",
    ]
    rows: dict[int, list[str]] = {}  # distance below the class row -> DOT names, left to right
    statements: list[str] = []
    titles: list[str] = []
    for k, (name, graph) in enumerate(pairs, start=1):
        prefix = "" if single else f"t{k}/"
        by_layer: dict[int, list[tuple[int, str, dict[str, Any]]]] = {}
        for node, data in graph.nodes(data=True):
            by_layer.setdefault(int(data["layer"]), []).append((int(data["index"]), node, data))
        top = max(by_layer, default=0)
        previous_label = None
        for layer in sorted(by_layer):
            label = "classes" if layer == top else "primary" if layer == 1 else f"layer {layer}"
            label_node = f"{prefix}layer:{layer}"
            statements.append(
                f"{_quote(label_node)} [shape=plaintext, style=solid, fixedsize=false, "
                f"label={_quote(label)}, fontsize=10, fontcolor=gray35]"
            )
            if previous_label:  # heavy and straight: the row labels stand in one column
                statements.append(
                    f"{_quote(previous_label)} -> {_quote(label_node)} [style=invis, weight=50]"
                )
            previous_label = label_node
            row = rows.setdefault(top - layer, [])  # class rows align across trees
            row.append(label_node)
            for _, node, data in sorted(by_layer[layer]):
                statements.append(f"{_quote(prefix + node)} {_attributes(_node_style(data, cmap))}")
                row.append(prefix + node)
        for child, parent, data in sorted(graph.edges(data=True)):
            statements.append(
                f"{_quote(prefix + child)} -> {_quote(prefix + parent)} "
                f"{_attributes(_edge_style(float(data['weight'])))}"
            )
        if not single and by_layer:
            head = f"{prefix}title"
            statements.append(
                f"{_quote(head)} [shape=plaintext, style=solid, fixedsize=false, "
                f"label={_quote(str(name))}, fontsize=13]"
            )
            # A heavy edge from the middle of the tree's top row places its title above it.
            top_row = sorted(by_layer[top])
            middle = prefix + top_row[len(top_row) // 2][1]
            statements.append(f"{_quote(middle)} -> {_quote(head)} [style=invis, weight=20]")
            titles.append(head)
    lines += ["\t" + statement for statement in statements]
    for depth, row in [*sorted(rows.items()), (None, titles)]:
        if not row:
            continue
        name = "titles" if depth is None else f"row {depth}"  # row 0: the classes
        lines.append(f"\tsubgraph {_quote(name)} {{")
        lines.append("\t\trank=same")
        for a, b in itertools.pairwise(row):
            # weight keeps a row compact where couplings would pull its nodes apart
            lines.append(f"\t\t{_quote(a)} -> {_quote(b)} [style=invis, weight=8]")
        lines.append("\t}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node_style(data: dict[str, Any], cmap: Any) -> dict[str, str]:
    activation = min(max(float(data["activation"]), 0.0), 1.0)
    red, green, blue, _ = cmap(activation)
    fill = f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}"
    luminance = 0.299 * red + 0.587 * green + 0.114 * blue
    style = {
        "label": str(data.get("label", data["index"])),
        "fillcolor": fill,
        "fontcolor": "black" if luminance > 0.5 else "white",
        "tooltip": f"{data.get('label', '')} ‖u‖={float(data['activation']):.3f}",
    }
    if data.get("class_name") is not None:
        style["shape"] = "doublecircle" if data.get("root") else "circle"
        style["width"] = style["height"] = "0.36" if data.get("root") else "0.42"
    if data.get("root"):
        style["penwidth"] = "2"
    if not data.get("in_tree", True):
        style.update(style="filled,dashed", fillcolor=fill + "40", fontcolor="gray50")
    return style


def _edge_style(weight: float) -> dict[str, str]:
    strength = min(max(weight, 0.0), 1.0)
    alpha = round(255 * (0.2 + 0.8 * strength))
    return {
        "penwidth": f"{0.4 + 3.6 * strength:.2f}",
        "color": f"#1f2f4f{alpha:02x}",
        "tooltip": f"c={weight:.3f}",
    }


def _quote(text: str) -> str:
    escaped = str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _attributes(attributes: dict[str, str]) -> str:
    return "[" + ", ".join(f"{key}={_quote(value)}" for key, value in attributes.items()) + "]"


def render_parse_tree(
    graph: Any,
    path: str | Path,
    *,
    format: str | None = None,
    title: str | None = None,
    colormap: str = "viridis",
) -> RenderedTree:
    """Draw one parse tree to ``path`` (SVG, PNG or PDF) and its DOT source beside it.

    Args:
        graph: A parse-tree graph.
        path: The picture (a file, not a folder); the DOT source goes beside it with suffix
            ``.gv`` in place of the picture's (``t.svg`` → ``t.gv``, shared by ``t.png``).
        format: ``svg``, ``png`` or ``pdf``; default: from the suffix of ``path``, else SVG
            (the suffix is then added).
        title: Title over the picture (default: the graph's ``title``).
        colormap: Matplotlib colormap of the activation.

    Raises:
        GraphvizNotFoundError: If the ``dot`` program is missing (the ``.gv`` is written).
        GraphvizRenderError: If ``dot`` fails, e.g. lacks the plugin of the format (the
            ``.gv`` is written).
        MissingDependencyError: If the graphviz Python package is missing (the ``.gv`` is
            written).
        InvalidInputError: On an unknown format, a graph that is not a parse tree, an empty
            path, a folder, or a path that cannot be written.
    """
    return _render(to_dot(graph, title=title, colormap=colormap), path, format)


def render_side_by_side(
    trees: Sequence[tuple[str, Any]],
    path: str | Path,
    *,
    format: str | None = None,
    title: str | None = None,
    colormap: str = "viridis",
) -> RenderedTree:
    """Draw several ``(title, graph)`` parse trees side by side in one picture.

    For example ``[("DR-CapsNet+Q", tree_q), ("DR-CapsNet+REM", tree_rem)]``. Arguments and
    errors as in :func:`render_parse_tree`.
    """
    pairs = [(str(name), graph) for name, graph in trees]
    return _render(to_dot(pairs, title=title, colormap=colormap), path, format)


def _render(source: str, path: str | Path, format: str | None) -> RenderedTree:
    path, format = _picture_path(path, format)
    source_path = path.with_suffix(".gv")
    for target in (path, source_path):  # fail before writing either, naming the picture
        check_output_path(target)
    write_atomically(source_path, lambda handle: handle.write(source.encode()))
    graphviz = require("graphviz", "rendering parse trees")
    try:
        # quiet: on failure dot's stderr goes into the one-line error, not above it as well
        picture = graphviz.Source(source, engine="dot").pipe(format=format, quiet=True)
    except graphviz.ExecutableNotFound:
        raise GraphvizNotFoundError(
            f"the graphviz `dot` program was not found on PATH, so {path.name} could not be "
            f"drawn; {DOT_INSTALL_HINT}. The DOT source was written to {source_path}; "
            "`text_tree(graph)` (or `explain parse-tree --text`) prints the tree in a terminal",
            source_path,
        ) from None
    except graphviz.CalledProcessError as failed:
        raise _dot_failed(failed, path, format, source_path) from failed
    write_atomically(path, lambda handle: handle.write(picture))
    return RenderedTree(path, source_path)


def _picture_path(path: str | Path, format: str | None) -> tuple[Path, str]:
    """The picture's path (its suffix added where it lacks one) and format.

    Raises:
        InvalidInputError: On an empty path, a folder or an unknown format.
    """
    if not str(path).strip():
        raise InvalidInputError(
            "the picture's path is empty; give a file name such as tree.svg (or .png, .pdf)"
        )
    path = Path(path)
    if path.is_dir():  # else "folder" would become folder.svg beside the folder
        raise OutputPathError(
            f"cannot write {path}: it is a folder; give a file name inside it instead, e.g. "
            f"{path / 'tree.svg'}"
        )
    suffix = path.suffix.lower().lstrip(".")
    if format is None:
        format = suffix if suffix in FORMATS else "svg"
    format = format.lower()
    if format not in FORMATS:
        raise InvalidInputError(f"unknown picture format {format!r}; choose one of {FORMATS}")
    if suffix != format:
        path = path.with_name(path.name + "." + format)
    return path, format


def _dot_failed(
    failed: Exception, path: Path, format: str, source_path: Path
) -> GraphvizRenderError:
    """Why ``dot`` could not draw ``path``, in one line, with what to do."""
    raw = getattr(failed, "stderr", None) or b""
    stderr = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    said = _dot_complaint(stderr)
    status = getattr(failed, "returncode", "?")
    return GraphvizRenderError(
        f"the graphviz `dot` program failed to draw {path.name} (exit status {status}): {said}. "
        f"Check that your graphviz supports {format} (`dot -T?` lists the formats it can "
        f"write; svg needs no plugin) or choose another format; the DOT source was written to "
        f"{source_path}, and `text_tree(graph)` prints the tree in a terminal",
        source_path,
        stderr,
    )


def _dot_complaint(stderr: str, limit: int = 300) -> str:
    """``dot``'s error in one line: its lines other than warnings, the last ``limit`` characters.

    A large graph can make ``dot`` warn once per node before it fails; the error comes last.
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not line.lower().startswith("warning")] or lines
    said = " ".join(" ".join(errors).split()).rstrip(".")  # the message adds its own full stop
    if not said:
        return "it wrote nothing on stderr"
    return said if len(said) <= limit else "…" + said[-limit:]
