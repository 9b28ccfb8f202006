"""Parse trees as plain text for terminals (no graphviz needed).

Each root class is printed first; below every capsule come its parts (the capsules coupled to it
from the layer beneath), strongest coupling first. A capsule that is part of several wholes is
expanded once; later occurrences end with ``(see above)``.
"""

from __future__ import annotations

from typing import Any

from explain_core.parse_trees.build import check_parse_tree

__all__ = ["text_tree"]


def text_tree(graph: Any, *, title: str | None = None) -> str:
    """Render a parse tree from :mod:`explain_core.parse_trees.build` as indented text.

    Args:
        graph: A parse-tree ``networkx.DiGraph``.
        title: First line; default: the graph's ``title`` attribute, if any.

    Returns:
        The tree, one capsule per line, e.g. ``└── L4:C2 C2 ‖u‖=0.73 c=0.81``; a tree whose
        couplings are all below the threshold ends with a line saying so.

    Raises:
        InvalidInputError: If ``graph`` is not a parse tree.
    """
    check_parse_tree(graph)
    lines = []
    heading = title if title is not None else graph.graph.get("title")
    if heading:
        lines.append(str(heading))
    roots = [n for n, d in graph.nodes(data=True) if d.get("root")]
    roots.sort(key=lambda n: graph.nodes[n]["index"])
    seen: set[str] = set()
    for root in roots:
        lines.append(_describe(graph, root, None))
        seen.add(root)
        _children(graph, root, "", seen, lines)
    if not roots:
        lines.append("(empty tree)")
    elif graph.number_of_edges() == 0:  # say so, rather than print bare roots
        thresholds = graph.graph.get("thresholds")  # one per routing layer
        above = f"thresholds {thresholds}" if thresholds else "threshold"
        lines.append(f"(no edges: no coupling is above the {above})")
    return "\n".join(lines) + "\n"


def _children(graph: Any, node: str, prefix: str, seen: set[str], lines: list[str]) -> None:
    parts = sorted(
        graph.predecessors(node),
        key=lambda p: (-graph.edges[p, node]["weight"], graph.nodes[p]["index"]),
    )
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        branch, indent = ("└── ", "    ") if last else ("├── ", "│   ")
        repeated = part in seen and any(True for _ in graph.predecessors(part))
        suffix = " (see above)" if repeated else ""
        lines.append(prefix + branch + _describe(graph, part, graph.edges[part, node]) + suffix)
        if not repeated:
            seen.add(part)
            _children(graph, part, prefix + indent, seen, lines)


def _describe(graph: Any, node: str, edge: dict[str, Any] | None) -> str:
    data = graph.nodes[node]
    text = f"{node} {data.get('label', '')} ‖u‖={data['activation']:.2f}"
    if edge is not None:
        text += f" c={edge['weight']:.2f}"
    return text
