"""Parse trees for other tools: GraphML (Gephi, yEd, Cytoscape) and node-link JSON (d3).

Both formats keep every node, edge and graph attribute with its type, so reading a file back
gives a graph equal to the one written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from explain_core.extras import require
from explain_core.files import check_output_path, write_atomically
from explain_core.parse_trees.build import check_parse_tree

__all__ = [
    "read_graphml",
    "read_node_link_json",
    "to_node_link",
    "write_graphml",
    "write_node_link_json",
]


def write_graphml(graph: Any, path: str | Path) -> Path:
    """Write ``graph`` as GraphML (atomically) and return the path.

    Raises:
        InvalidInputError: If ``graph`` is not a parse tree or ``path`` cannot be written.
    """
    nx = require("networkx", "parse-tree graphs")
    check_parse_tree(graph)
    return write_atomically(Path(path), lambda handle: nx.write_graphml(graph, handle))


def read_graphml(path: str | Path) -> Any:
    """Read a parse tree written by :func:`write_graphml` (node ids stay strings)."""
    nx = require("networkx", "parse-tree graphs")
    graph = nx.read_graphml(Path(path), node_type=str)
    # networkx adds empty defaults on reading; drop them so a round trip gives the same graph.
    for key in ("node_default", "edge_default"):
        if graph.graph.get(key) == {}:
            del graph.graph[key]
    return graph


def to_node_link(graph: Any) -> dict[str, Any]:
    """The node-link form of ``graph`` (``{"nodes": [...], "edges": [...], "graph": {...}}``).

    Raises:
        InvalidInputError: If ``graph`` is not a parse tree.
    """
    nx = require("networkx", "parse-tree graphs")
    check_parse_tree(graph)
    try:
        return nx.node_link_data(graph, edges="edges")
    except TypeError:  # networkx < 3.4 names the keyword `link`
        return nx.node_link_data(graph, link="edges")


def write_node_link_json(graph: Any, path: str | Path) -> Path:
    """Write the node-link form of ``graph`` as JSON (atomically) and return the path.

    Raises:
        InvalidInputError: If ``graph`` is not a parse tree or ``path`` cannot be written.
    """
    path = check_output_path(path)  # before the conversion, which may take a while
    text = json.dumps(to_node_link(graph), indent=1, ensure_ascii=False)
    return write_atomically(path, lambda handle: handle.write(text.encode()))


def read_node_link_json(path: str | Path) -> Any:
    """Read a parse tree written by :func:`write_node_link_json`."""
    nx = require("networkx", "parse-tree graphs")
    data = json.loads(Path(path).read_text())
    try:
        return nx.node_link_graph(data, edges="edges")
    except TypeError:  # networkx < 3.4
        return nx.node_link_graph(data, link="edges")
